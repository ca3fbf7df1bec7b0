"""`python -m minirt bench` in CPU mode, tiny `--quick` workloads, run as a user would (subprocess).

Checks the JSON report's fields, that every ratio and derived figure follows from the measured numbers,
and that the tables print. No timing thresholds: the figures depend on the machine.
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest

SYSTEM_FIELDS = ("num_requests", "output_tokens", "wall_time_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "how")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", "--quick", "--threads", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.glob("cpu-quick-*.json"))
    assert len(files) == 1, files
    return proc.stdout, json.loads(files[0].read_text())


def test_report_fields(bench_run):
    _, report = bench_run
    assert report["device"]["type"] == "cpu" and report["device"]["name"] and report["device"]["num_threads"] == 1
    for package in ("python", "torch", "transformers", "triton", "minirt"):
        assert package in report["versions"]
    assert report["settings"]["quick"] is True and report["settings"]["dtype"] == "float32"
    assert set(report["settings"]["workloads"]) == {"throughput", "latency"}
    assert report["model"]["weight_bytes"] > 0 and report["bandwidth"]["bytes_per_s"] > 0
    assert report["correctness"]["exact_match"] == 1.0      # float32: token-for-token equal to transformers
    for workload, settings in report["settings"]["workloads"].items():
        systems = report["results"][workload]
        assert set(systems) == {"minirt", "hf_generate"}
        for name, fig in systems.items():
            assert "error" not in fig, (workload, name, fig.get("error"))
            for field in SYSTEM_FIELDS:
                assert fig[field] is not None, (workload, name, field)
            assert fig["num_requests"] == settings["num_requests"]
            assert fig["output_tokens"] == settings["num_requests"] * settings["max_new_tokens"]


def test_ratios_follow_from_the_measured_numbers(bench_run):
    _, report = bench_run
    results = report["results"]
    bandwidth = report["bandwidth"]["bytes_moved"] / report["bandwidth"]["seconds"]
    assert report["bandwidth"]["bytes_per_s"] == pytest.approx(bandwidth)
    for systems in results.values():
        for fig in systems.values():
            assert fig["output_tokens_per_s"] == pytest.approx(fig["output_tokens"] / fig["wall_time_s"])
    for fig in results["latency"].values():
        assert fig["roofline_fraction"] == pytest.approx(
            report["model"]["weight_bytes"] / fig["tpot_p50_s"] / bandwidth)
    ratios = {(r["workload"], r["name"]): r for r in report["ratios"]}
    expected = {(w, "tokens_per_s_vs_hf_generate"): results[w]["minirt"]["output_tokens_per_s"]
                / results[w]["hf_generate"]["output_tokens_per_s"] for w in results}
    expected["latency", "roofline_fraction"] = results["latency"]["minirt"]["roofline_fraction"]
    assert set(ratios) == set(expected)
    for key, value in expected.items():
        r = ratios[key]
        assert r["value"] == pytest.approx(value), key
        if r["target"] is None:
            assert r["status"] is None
        else:
            assert r["status"] == ("PASS" if value >= r["target"] else "MISS"), key
    assert ratios["throughput", "tokens_per_s_vs_hf_generate"]["target"] == 2.0


def test_tables_print(bench_run):
    stdout, report = bench_run
    assert "copy bandwidth" in stdout and "greedy tokens equal" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("workload") and "system" in line)
    for column in ("tok/s", "TTFT p50", "TPOT p99", "roofline"):
        assert column in header
    for workload, systems in report["results"].items():
        for name in systems:
            assert any(line.split()[:2] == [workload, name] for line in stdout.splitlines()), (workload, name)
    assert any("tokens_per_s_vs_hf_generate" in line and ("PASS" in line or "MISS" in line)
               for line in stdout.splitlines())


def _benchmark_module(name: str):
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))           # as `python benchmarks/X.py` has it: `from harness import ...`
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_benchmark_parses_settings_and_refuses_bad_ones(capsys):
    """benchmarks/ab.py: each --config is NAME:field=value,...; a malformed one, a bad value or a field the engine
    does not know exits 2 with the text named, before any model is built (and, on the CPU, it needs CUDA)."""
    ab = _benchmark_module("ab")
    from harness import parse_engine_settings
    assert parse_engine_settings("x:kv_write_in_rotary=on,num_scheduler_steps=4,pdl=auto") == (
        "x", {"kv_write_in_rotary": True, "num_scheduler_steps": 4, "pdl": None})
    for name, kwargs in map(parse_engine_settings, ab.DEFAULT_CONFIGS):
        assert set(kwargs) == {"kv_write_in_rotary", "combine_in_attention"}
    for bad, words in (("nocolon", "expected NAME:field=value"), ("x:pdl", "expected field=value in 'x:pdl'"),
                       ("x:pdl=maybe", "pdl's value must be on, off, auto or an integer, got 'maybe'"),
                       ("x:warp_speed=on", "unknown engine fields ['warp_speed']"),
                       ("x:block_size=0", "block_size: must be an integer >= 1, got 0")):
        assert ab.main(["--config", bad]) == 2
        assert words in capsys.readouterr().err
    assert ab.main(["--rounds", "0"]) == 2 and "--rounds: must be >= 1, got 0" in capsys.readouterr().err
    assert ab.main(["--label", "a/b"]) == 2 and "--label: only letters, digits and '-', got 'a/b'" in \
        capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert ab.main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_launch_floor_benchmark_refuses_bad_arguments_and_needs_cuda(capsys):
    floor = _benchmark_module("launch_floor")
    assert floor.main(["--kernels", "0"]) == 2 and "--kernels: must be >= 1, got 0" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert floor.main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


def _bench_args(*argv):
    import argparse

    from minirt import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_engine_switches_from_the_command_line():
    from minirt.bench import engine_kwargs_of

    assert engine_kwargs_of(_bench_args()) == {}                # defaults: nothing overridden
    args = _bench_args("--attention-backend", "torch", "--no-split-kv", "--enforce-eager", "--fused-ops", "off",
                       "--merge-projections", "on", "--gemv", "off")
    assert engine_kwargs_of(args) == {"attention_backend": "torch", "split_kv": False, "enforce_eager": True,
                                      "fused_ops": False, "merge_projections": True, "gemv": False}
    args = _bench_args("--norm-in-gemv", "off", "--rotary-kernel", "on", "--pdl", "off", "--kv-write-in-rotary", "off",
                       "--combine-in-attention", "on", "--prefetch-kv", "off", "--l2-prefetch", "on",
                       "--num-scheduler-steps", "4")
    assert engine_kwargs_of(args) == {"norm_in_gemv": False, "rotary_kernel": True, "pdl": False,
                                      "kv_write_in_rotary": False, "combine_in_attention": True,
                                      "prefetch_kv": False, "l2_prefetch": True, "num_scheduler_steps": 4}


def test_every_auto_switch_is_a_bench_flag():
    """Each `EngineConfig` switch that takes None (`AUTO_SWITCHES`) has its `--name on|off|auto` flag in the bench,
    and each flag reaches the engine's settings by its field's name."""
    from minirt.bench import ON_OFF_SWITCHES, engine_kwargs_of
    from minirt.config import AUTO_SWITCHES

    assert sorted(name for name, _ in ON_OFF_SWITCHES) == sorted(AUTO_SWITCHES)
    for name in AUTO_SWITCHES:
        assert engine_kwargs_of(_bench_args("--" + name.replace("_", "-"), "off")) == {name: False}


@pytest.mark.parametrize("argv,words", [(["--threads", "0"], "--threads: must be an integer >= 1"),
                                        (["--attention-backend", "triton"], "attention_backend: 'triton' needs"),
                                        (["--gemv", "on"], "gemv: the Triton matrix-vector kernel needs"),
                                        (["--rotary-kernel", "on"], "rotary_kernel: the Triton kernel needs"),
                                        (["--pdl", "on"], "pdl: programmatic dependent launch needs"),
                                        (["--kv-write-in-rotary", "on"], "kv_write_in_rotary: the K/V write in the rotary kernel needs rotary_kernel"),
                                        (["--combine-in-attention", "on"], "combine_in_attention: the split combine in the attention kernel needs attention_backend='triton'"),
                                        (["--combine-in-attention", "on", "--no-split-kv"],
                                         "and split_kv (off: split_kv=False)"),
                                        (["--prefetch-kv", "on"], "prefetch_kv: loading K/V before the PDL wait needs pdl (off: needs a CUDA device"),
                                        (["--prefetch-kv", "on", "--pdl", "off"],
                                         "prefetch_kv: loading K/V before the PDL wait needs pdl (off: pdl=False)"),
                                        (["--l2-prefetch", "on"], "l2_prefetch: the bulk prefetch into L2 needs"),
                                        (["--l2-prefetch", "on", "--gemv", "off"],
                                         "and gemv (off: gemv=False)")])
def test_bad_bench_arguments_exit_2_with_a_message(argv, words):
    if ("triton" in argv or "on" in argv) and __import__("torch").cuda.is_available():
        pytest.skip("a valid setting on a CUDA machine")
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", *argv], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"), check=False)
    assert proc.returncode == 2 and words in proc.stderr, (proc.returncode, proc.stderr[-1000:])


@pytest.mark.parametrize("script", ["profile_throughput", "step_timeline", "batch1_ablation", "batch1_timeline"])
def test_cuda_only_scripts_exit_2_without_cuda(script):
    if __import__("torch").cuda.is_available():
        pytest.skip("the script runs for real on CUDA: exercised by the GPU runs, not here")
    assert _benchmark_module(script).main([]) == 2


@pytest.mark.parametrize("argv", [["--tree", "a=."], ["--tree", "a=.", "--tree", "b=.", "--rounds", "0"],
                                  ["--tree", "a=.", "--tree", "b=.", "--repeats", "0"]])
def test_ab_commits_refuses_bad_arguments(argv, capsys):
    assert _benchmark_module("ab_commits").main(argv) == 2
    assert "--repeats >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad,words", [("c:async_scheduling=on", "--settings: 'c' is not a --tree name (a, b)"),
                                       ("a:warp=on", "--settings: unknown engine fields ['warp']"),
                                       ("a:pdl=maybe", "--settings: pdl's value must be on, off, auto")])
def test_ab_commits_refuses_bad_settings_before_running(bad, words, capsys):
    assert _benchmark_module("ab_commits").main(["--tree", "a=.", "--tree", "b=.", "--settings", bad]) == 2
    assert words in capsys.readouterr().err


def test_profile_throughput_ceiling_counts_every_step_of_every_sequence():
    """`ceiling` against the sum written out by hand: prompts of 1 and 3 tokens, 2 decode steps, 10 bytes of K/V
    per token of context, 100 bytes of weights, 1,000 bytes/s, 2 parameters, 16 FLOP/s."""
    ceiling = _benchmark_module("profile_throughput").ceiling
    got = ceiling([[7], [1, 2, 3]], 2, weight_bytes=100, params=2, kv_bytes_per_token=10, bw=1000.0, flops=16.0)
    kv = 10 * ((1 + 0) + (1 + 1) + (3 + 0) + (3 + 1))              # context = prompt + step, steps 0 and 1
    assert got["kv_bytes_read"] == kv == 100
    assert got["decode_s"] == pytest.approx((2 * 100 + kv) / 1000)
    assert got["prefill_s"] == pytest.approx(2 * 2 * 4 / 16)
    assert got["output_tokens_per_s"] == pytest.approx(4 / (0.3 + 1.0))


def test_profile_throughput_windows_pick_prefill_steps_the_first_and_full_bursts():
    windows_for = _benchmark_module("profile_throughput").windows_for
    calls = ([{"kind": "prefill", "rows": r} for r in (8, 16, 24, 32, 40, 48)] + [{"kind": "decode", "rows": 48}]
             + [{"kind": "burst", "rows": r} for r in (48, 48, 48, 48, 47)])
    assert windows_for(calls) == {2: ("prefill", 1), 3: ("prefill", 1), 4: ("prefill", 1), 7: ("first_burst", 1),
                                  9: ("burst", 3)}


def test_interleaved_variants_builds_each_on_one_checkpoint_then_times_them_all(monkeypatch):
    """benchmarks/ab.py's `interleaved_variants` (ab.py, batch1_ablation.py and lab probes build their engines
    with it): one checkpoint, every variant built from its path before any is timed, and the timing over all of
    them, with the checkpoint's folder still there while they run."""
    ab = _benchmark_module("ab")
    paths, events = [], []

    def fake_checkpoint(path, device, seed):
        paths.append(path)
        return path

    def fake_tpot(llms, rounds, device, around):
        events.append(("timed", sorted(llms), rounds, all(__import__("os").path.isdir(p) for p in paths), around))
        return {name: [0.001] * rounds for name in llms}

    @contextlib.contextmanager
    def patched():
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(ab, "build_random_qwen3", fake_checkpoint)
    monkeypatch.setattr(ab, "interleaved_tpot", fake_tpot)
    build = {name: (lambda model, name=name: events.append(("built", name, model)) or f"llm-{name}") for name in "ab"}
    llms, tpot = ab.interleaved_variants(build, 3, "cpu", around={"b": patched})
    assert llms == {"a": "llm-a", "b": "llm-b"} and tpot == {"a": [0.001] * 3, "b": [0.001] * 3}
    assert events == [("built", "a", paths[0]), "enter", ("built", "b", paths[0]), "exit",
                      ("timed", ["a", "b"], 3, True, {"b": patched})]
    assert len(paths) == 1


def test_interleaved_tpot_runs_each_variant_inside_its_context(monkeypatch):
    """`interleaved_tpot`: a variant's warm-up and every timed run happen inside `around[name]()` (the patched kernel
    choices of lab/probes/kernel_choices.py, which eager steps read too); the other variants' runs outside it."""
    ab = _benchmark_module("ab")
    state = {"inside": None}
    runs = []

    @contextlib.contextmanager
    def patched():
        state["inside"] = "b"
        yield
        state["inside"] = None

    class FakeLLM:
        def __init__(self, name):
            self.name = name
            self.engine = type("E", (), {"model": type("M", (), {"config": type("C", (), {"vocab_size": 50})})})

    def fake_run(llm, prompts, new_tokens, device):
        runs.append((llm.name, state["inside"], new_tokens))
        return {"tpot_p50_s": 0.001}, None

    monkeypatch.setattr(ab, "run_minirt", fake_run)
    tpot = ab.interleaved_tpot({"a": FakeLLM("a"), "b": FakeLLM("b")}, 2, "cpu", around={"b": patched})
    assert tpot == {"a": [0.001] * 2, "b": [0.001] * 2}
    assert runs == [("a", None, 16), ("b", "b", 16), ("a", None, 256), ("b", "b", 256), ("b", "b", 256),
                    ("a", None, 256)]


def test_readme_switches_table_is_generated_from_rules():
    """benchmarks/README.md's switches table equals what benchmarks/switches_table.py writes from `RULES` (one row
    per rule, in order), so a rule added, renamed or re-ordered fails here until the table is regenerated."""
    from minirt.fast.plan import RULES

    table = _benchmark_module("switches_table")
    readme = table.in_readme(table.README.read_text())
    assert readme == table.table(), "run: python benchmarks/switches_table.py --write"
    rows = readme.splitlines()[2:]
    assert [row.split("|")[1].strip(" `") for row in rows] == [rule.name for rule in RULES]
    assert table.main(["--check"]) == 0


def test_bench_runs_several_quantizations_in_one_report(tmp_path):
    """`--quantization none,int8 --baselines none`: minirt twice on the same prompts, the int8 system's step bytes
    counted independently here (the float model's bytes, less its decoder linears' float weights, plus one byte per
    weight and a float32 scale per output channel), its roofline at those bytes, its ratios named by system."""
    import torch

    import minirt

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", "--quick", "--threads", "1",
                           "--workload", "latency", "--baselines", "none", "--quantization", "int8,none",
                           "--out", str(tmp_path), "--name", "quant"], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "quant.json").read_text())
    assert list(report["results"]["latency"]) == ["minirt", "minirt_int8"]      # unquantized first
    assert "correctness" not in report                                            # no transformers baseline ran
    model, _ = minirt.load_model(minirt.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    int8_bytes = float_bytes - sum(m.weight.numel() * 4 - m.weight.numel() - m.out_features * 4 for m in linears)
    q = report["quantization"]
    assert q["minirt"]["weight_bytes"] == report["model"]["weight_bytes"] == float_bytes
    assert q["minirt_int8"]["weight_bytes"] == int8_bytes < float_bytes
    assert q["minirt_int8"]["quantization"] == "int8" and q["minirt_int8"]["engine_resolved"]["quantization"] == "int8"
    assert 0 <= q["minirt_int8"]["greedy_vs_minirt"]["exact_match"] <= 1
    fig = report["results"]["latency"]["minirt_int8"]
    bandwidth = report["bandwidth"]["bytes_per_s"]
    assert fig["roofline_fraction"] == pytest.approx(int8_bytes / fig["tpot_p50_s"] / bandwidth)
    ratios = {r["name"]: r["value"] for r in report["ratios"]}
    assert ratios["minirt_int8:tokens_per_s_vs_minirt"] == pytest.approx(
        fig["output_tokens_per_s"] / report["results"]["latency"]["minirt"]["output_tokens_per_s"])
    assert ratios["minirt_int8:roofline_fraction"] == fig["roofline_fraction"]
    assert "minirt_int8: " in proc.stdout and "GB read per batch-1 step" in proc.stdout


@pytest.mark.parametrize("text", ["int4", "fp8,fp8", "none,,int8"])
def test_bench_refuses_bad_quantization_lists(text):
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", "--quantization", text],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                          check=False)
    assert proc.returncode == 2 and "quantization: a comma-separated list of distinct" in proc.stderr, proc.stderr


def test_bench_runs_speculation_beside_the_plain_engine_in_one_report(tmp_path):
    """`--speculative none,ngram --num-speculative-tokens 3 --baselines none`: minirt twice on the same prompts, the
    plain system first; k goes to the speculative system only; its greedy tokens equal the plain engine's (float32);
    its drafting figures are reported, and its tok/s over the plain engine's is a ratio named by system on both
    workloads, as the measured numbers give it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", "--quick", "--threads", "1",
                           "--baselines", "none", "--speculative", "none,ngram", "--num-speculative-tokens", "3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("cpu-quick-spec-none-ngram-num-speculative-tokens-3-*.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    report = json.loads(files[0].read_text())
    spec = report["speculative"]
    assert list(spec) == ["minirt", "minirt_ngram"] and "quantization" not in report
    plain, ngram = spec["minirt"]["engine_resolved"], spec["minirt_ngram"]["engine_resolved"]
    assert (plain["speculative"], plain["num_speculative_tokens"]) == (None, 0)
    assert (ngram["speculative"], ngram["num_speculative_tokens"], ngram["speculative_max_batch"]) == ("ngram", 3, 32)
    assert spec["minirt_ngram"]["greedy_vs_minirt"]["exact_match"] == 1.0
    ratios = {(r["workload"], r["name"]): r for r in report["ratios"]}
    for workload, systems in report["results"].items():
        assert list(systems) == ["minirt", "minirt_ngram"]
        assert "spec_drafts" not in systems["minirt"] and systems["minirt_ngram"]["spec_drafts"] >= 0
        r = ratios[workload, "minirt_ngram:tokens_per_s_vs_minirt"]
        assert r["value"] == pytest.approx(systems["minirt_ngram"]["output_tokens_per_s"]
                                           / systems["minirt"]["output_tokens_per_s"])
        assert r["target"] is None and r["status"] is None                  # the goal is the GPU's
    assert "minirt_ngram: k = 3, drafting at a running batch <= 32" in proc.stdout
    assert "minirt_ngram:tokens_per_s_vs_minirt" in proc.stdout


@pytest.mark.parametrize("argv,words", [
    (["--speculative", "eagle"], "speculative: a comma-separated list of distinct ['none', 'ngram', 'draft']"),
    (["--speculative", "ngram,ngram"], "speculative: a comma-separated list of distinct"),
    (["--speculative", "none,,ngram"], "speculative: a comma-separated list of distinct"),
    (["--speculative", "none", "--num-speculative-tokens", "3"],
     "num_speculative_tokens: set, but --speculative names no 'ngram' or 'draft' entry"),
    (["--speculative", "none,ngram", "--speculative-model", "x"],
     "speculative_model: set, but --speculative names no 'draft' entry")])
def test_bench_refuses_bad_speculative_lists(argv, words, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minirt.bench", "--device", "cpu", "--quick", "--out", str(tmp_path),
                           *argv], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"), check=False)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-1000:]


def test_variant_ratios_and_their_goals_on_cuda():
    """Made-up figures: each variant's tok/s over plain minirt's on every workload; a speculative system's goal is
    not to lose on the throughput workload (`SPEC_TARGETS`), a quantized one's are chapter 10's (`QUANT_TARGETS`),
    a system that is both has none; the quantized ones' latency figures only for quantized systems."""
    from minirt.bench import compute_ratios

    def fig(tok_s, tpot=None):
        return {"output_tokens_per_s": tok_s, "tpot_p50_s": tpot, "roofline_fraction": 0.5 if tpot else None}

    results = {"throughput": {"minirt": fig(100.0), "minirt_ngram": fig(101.0), "minirt_fp8": fig(90.0),
                              "minirt_fp8_ngram": fig(80.0)},
               "latency": {"minirt": fig(10.0, 1e-3), "minirt_ngram": fig(8.0, 1.2e-3),
                           "minirt_fp8": fig(12.0, 0.3e-3), "minirt_fp8_ngram": fig(9.0, 0.4e-3)}}
    systems = {"minirt": {"quantization": None, "speculative": None},
               "minirt_ngram": {"quantization": None, "speculative": "ngram"},
               "minirt_fp8": {"quantization": "fp8", "speculative": None},
               "minirt_fp8_ngram": {"quantization": "fp8", "speculative": "ngram"}}
    ratios = {(r["workload"], r["name"]): r for r in compute_ratios(results, "cuda", systems)}
    assert ratios["throughput", "minirt_ngram:tokens_per_s_vs_minirt"] == {
        "workload": "throughput", "name": "minirt_ngram:tokens_per_s_vs_minirt", "value": pytest.approx(1.01),
        "target": 1.0, "status": "PASS"}
    assert ratios["latency", "minirt_ngram:tokens_per_s_vs_minirt"]["target"] is None
    assert ("latency", "minirt_ngram:roofline_fraction") not in ratios
    assert ratios["throughput", "minirt_fp8:tokens_per_s_vs_minirt"]["status"] == "MISS"
    assert ratios["latency", "minirt_fp8:tpot_p50_s"]["status"] == "PASS"          # 0.30 ms, at most 0.40
    assert ratios["latency", "minirt_fp8_ngram:tpot_p50_s"]["target"] is None
    assert ratios["throughput", "minirt_fp8_ngram:tokens_per_s_vs_minirt"]["target"] is None
    results["throughput"]["minirt_ngram"] = fig(99.0)
    ratios = {(r["workload"], r["name"]): r for r in compute_ratios(results, "cuda", systems)}
    assert ratios["throughput", "minirt_ngram:tokens_per_s_vs_minirt"]["status"] == "MISS"
