"""The batch-1 step under other kernel choices (GEMV tiles, split-KV splits): TPOT per choice, interleaved.

    python lab/probes/kernel_choices.py [--rounds 6] [--variants NAME,NAME,...] [--label LABEL]
                                        [--out lab/results/kernel-choices-and-tiles]

The kernels' launch choices are module constants and small functions (`minirt.kernels.gemv_triton.choose_config`
and its constants; in `minirt.kernels.paged_attention_triton`, `choose_num_splits`' `MAX_SPLITS` and the split-KV
launch's `SPLIT_TILE`). Here each variant is a `minirt.LLM` on the same random Qwen3-0.6B-shaped checkpoint built and
run with some of them patched (its decode graphs are captured while it is built), timed in interleaved rounds as
`ab.py` times engine settings (512-token prompt, 256 new tokens; the first variant is the baseline). The GEMV variants follow the
`--chain` sweep of `gemv.py`, which found down_proj faster in 2 x 2048 tiles with 8 warps in the GEMV chain
alone (`lab/results/gemv-chain/triton-persistent-chain.json`); the split variants ask how many programs
should share a short context's keys, and how many keys each should take.
Writes `kernel-choices-cuda-<date>[-LABEL].json`, with each variant's choices as they stood inside its patches
(`choices`). Needs CUDA. The figures: `lab/pages/kernel-choices-and-tiles.md`.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from ab import interleaved_variants, new_llm, report_tpot  # noqa: E402
from harness import cuda_script_args  # noqa: E402
from minirt.kernels import gemv_triton, paged_attention_triton  # noqa: E402

DOWN_PROJ, O_PROJ = (1024, 3072), (1024, 2048)      # Qwen3-0.6B's weights [out, in]


def _tiles(configs: dict):
    """`choose_config` returning `configs[(n, k)]` for weights of those shapes and its own choice for the others."""
    original = gemv_triton.choose_config

    def choose(n, k, sm_count, split_k=True):
        return configs.get((n, k)) or original(n, k, sm_count, split_k)
    return mock.patch.object(gemv_triton, "choose_config", choose)


@contextlib.contextmanager
def _constants(module, **values):
    """The module's constants set to `values` for the block (AttributeError for a name it does not have)."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def _splits(max_splits: int, tile: tuple[int, int, int] | None = None):
    """At most max_splits split-KV programs per (sequence, KV head), each with `tile` (keys, warps, stages)."""
    return _constants(paged_attention_triton, MAX_SPLITS=max_splits,
                      **({"SPLIT_TILE": tile} if tile else {}))


G = gemv_triton.GemvConfig
VARIANTS = {      # name -> () -> a context manager the variant is built and run in
    "default": contextlib.nullcontext,
    "one-row 4096": lambda: _constants(gemv_triton, MAX_BLOCK_K=4096),     # the one-row GEMV tile before 2,048 columns
    "down 2x2048 w8": lambda: _tiles({DOWN_PROJ: G(2, 2048, 1, 8)}),
    "down 1x2048 w4": lambda: _tiles({DOWN_PROJ: G(1, 2048, 1, 4)}),
    "o+down 2x2048 w8": lambda: _tiles({DOWN_PROJ: G(2, 2048, 1, 8), O_PROJ: G(2, 2048, 1, 8)}),
    "splits 8": lambda: _splits(8),
    "splits 8 keys 128": lambda: _splits(8, (128, 8, 2)),
    "splits 32": lambda: _splits(32),
    "splits 16 keys 32": lambda: _splits(16, (32, 4, 2)),
    "splits 32 keys 32": lambda: _splits(32, (32, 4, 2)),
    "splits 32 keys 32 w8": lambda: _splits(32, (32, 8, 2)),
    "splits 64 keys 16": lambda: _splits(64, (16, 4, 2)),
}


def choices(sm_count: int) -> dict:
    """The launch choices as they stand (inside a variant's patches): the GEMV tiles of down_proj and o_proj for
    `sm_count` SMs and the split-KV constants."""
    return {"down_proj": list(gemv_triton.choose_config(*DOWN_PROJ, sm_count)),
            "o_proj": list(gemv_triton.choose_config(*O_PROJ, sm_count)),
            "MAX_BLOCK_K": gemv_triton.MAX_BLOCK_K, "MAX_SPLITS": paged_attention_triton.MAX_SPLITS,
            "SPLIT_TILE": list(paged_attention_triton.SPLIT_TILE)}


def variant_names(text: str) -> list[str]:
    """"A,B,..." -> the names, each a key of VARIANTS and given once; ValueError naming --variants otherwise."""
    names = text.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        raise ValueError(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--variants: each name once, got {names}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--rounds",), {"type": int, "default": 6}),
                            (("--variants",), {"default": ",".join(VARIANTS)}), (("--label",), {"default": ""}),
                            out_dir=str(REPO / "lab" / "results" / "kernel-choices-and-tiles"))
    if args is None:
        return 2
    try:
        names = variant_names(args.variants)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    llms, tpot = interleaved_variants({n: (lambda model: new_llm(model, device)) for n in names}, args.rounds, device,
                                      around={n: VARIANTS[n] for n in names})
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    settings = {}
    for n in names:
        with VARIANTS[n]():
            settings[n] = {"choices": choices(sm_count), "plan": llms[n].engine.plan.as_dict()}
    report_tpot(tpot, settings, args.rounds, device, args.out,
                "-".join(filter(None, ["kernel-choices-cuda", str(datetime.date.today()), args.label])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
