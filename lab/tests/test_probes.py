"""The lab's probe scripts (lab/probes/*.py) on a machine without CUDA: each refuses bad arguments with the field
named and exits 2 where it needs a GPU; the kernel-choice variants patch what they name and restore it. Oracle: the
modules' own constants and `choose_config`, read before and after each patch."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _probe(name: str):
    """lab/probes/<name>.py as a module, with benchmarks/ on sys.path as the probe puts it (harness, ab)."""
    path = ROOT / "lab" / "probes" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"lab/probes/{name}.py is not in this tree")
    for folder in (ROOT, ROOT / "benchmarks", path.parent):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["overlap_probe", "persistent_attention_probe", "decode_gemms", "sync_floor",
                                    "split_tile", "kernel_choices", "decode_attention", "combine_o_proj_probe",
                                    "prefill_kernels"])
def test_cuda_only_probes_exit_2_without_cuda(script):
    if __import__("torch").cuda.is_available():
        pytest.skip("the probe runs for real on CUDA: exercised by the GPU runs, not here")
    if script not in ("sync_floor", "split_tile"):
        pytest.importorskip("triton")                     # the Triton kernels they define, at import
    argv = ["--base", "."] if script == "prefill_kernels" else []
    assert _probe(script).main(argv) == 2


def test_l2_prefetch_benchmark_refuses_bad_arguments(capsys):
    l2 = _probe("l2_prefetch")
    assert l2.main(["--rounds", "0"]) == 2 and "--rounds: must be >= 1, got 0" in capsys.readouterr().err
    assert list(l2.SCHEMES.values())[:2] == [None, (1, 1)]       # the baseline first, then the engine's default
    if not __import__("torch").cuda.is_available():
        assert l2.main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_gemv_benchmark_needs_cuda(monkeypatch, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("the script runs for real on CUDA: exercised by the GPU runs, not here")
    monkeypatch.setattr("sys.argv", ["gemv.py", "--quick"])
    assert _probe("gemv").main() == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_kernel_choices_variants_patch_what_they_name_and_restore_it():
    """lab/probes/kernel_choices.py: a tile variant changes `choose_config` for its weight shapes only, a constant
    variant sets its module's constants, and both leave the modules as they were after the block."""
    pytest.importorskip("triton")
    kernel_choices = _probe("kernel_choices")
    from minirt.kernels import gemv_triton, paged_attention_triton

    shapes = {"down": (1024, 3072), "o_proj": (1024, 2048), "qkv": (4096, 1024)}
    before = {name: gemv_triton.choose_config(*shape, 132) for name, shape in shapes.items()}
    with kernel_choices.VARIANTS["down 2x2048 w8"]():
        assert gemv_triton.choose_config(*shapes["down"], 132) == gemv_triton.GemvConfig(2, 2048, 1, 8)
        assert gemv_triton.choose_config(*shapes["o_proj"], 132) == before["o_proj"]
        assert gemv_triton.choose_config(*shapes["qkv"], 132) == before["qkv"]
    with kernel_choices.VARIANTS["o+down 2x2048 w8"]():
        assert gemv_triton.choose_config(*shapes["o_proj"], 132) == gemv_triton.GemvConfig(2, 2048, 1, 8)
    assert {name: gemv_triton.choose_config(*shape, 132) for name, shape in shapes.items()} == before
    splits, tile = paged_attention_triton.MAX_SPLITS, paged_attention_triton.SPLIT_TILE
    with kernel_choices.VARIANTS["splits 32 keys 32"]():
        assert (paged_attention_triton.MAX_SPLITS, paged_attention_triton.SPLIT_TILE) == (32, (32, 4, 2))
    with kernel_choices.VARIANTS["one-row 4096"]():
        assert gemv_triton.choose_config(*shapes["down"], 132).block_k == 4096
    assert (paged_attention_triton.MAX_SPLITS, paged_attention_triton.SPLIT_TILE) == (splits, tile)
    assert gemv_triton.choose_config(*shapes["down"], 132) == before["down"]
    with kernel_choices.VARIANTS["splits 8 keys 128"]():                    # what the report records per variant
        got = kernel_choices.choices(132)
    assert (got["MAX_SPLITS"], got["SPLIT_TILE"], got["down_proj"]) == (8, [128, 8, 2], list(before["down"]))
    with pytest.raises(AttributeError), kernel_choices._constants(paged_attention_triton, MAX_SPLITS=4, NO_SUCH=1):
        pass
    assert paged_attention_triton.MAX_SPLITS == splits                        # the first patch undone too


def test_kernel_choices_variant_names_are_known_and_given_once():
    pytest.importorskip("triton")
    variant_names = _probe("kernel_choices").variant_names
    assert variant_names("default,splits 8") == ["default", "splits 8"]
    with pytest.raises(ValueError, match=r"^--variants: each name once, got \['default', 'default'\]"):
        variant_names("default,default")
    with pytest.raises(ValueError, match=r"^--variants: unknown \[' 128 keys'\]"):
        variant_names("splits 8, 128 keys")
