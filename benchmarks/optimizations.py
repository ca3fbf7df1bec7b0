"""What each GPU optimization buys: minirt alone, the optimizations of chapter 07 turned on one by one.

    python benchmarks/optimizations.py [--quick] [--steps 0,2,5] [--out benchmarks/results]
    python benchmarks/optimizations.py --profile [--new-tokens 64] [--steps ...]

Runs the `python -m minirt bench` workloads (see `minirt/bench.py`) on the same random Qwen3-0.6B-shaped
checkpoint for each step of `STEPS`, each step adding one switch of `minirt.EngineConfig` to the one
before. transformers runs only as the correctness guard (4 prompts x 32 greedy tokens each step).
Prints a table of output tokens/s, TPOT p50 and the roofline fraction per step, with each step's speed-up
over the first, and writes `optimizations-<device>[-quick]-<date>.json` (every figure of every step).
Chapter 07 plots that file.

`--profile`: where a batch-1 decode step's time goes, per step. One request (512-token prompt) profiled
with `torch.profiler` (CPU and CUDA activities); a prefill-only run (1 new token) is subtracted from a run of
`--new-tokens`, so the figures are per decode step: wall time, GPU kernel time (the sum of kernel durations),
kernels launched, and the five kernels that take most time. A step whose wall time far exceeds its kernel
time is launch- or CPU-bound; one where they are close is GPU-bound. Writes `profile-decode-cuda-<date>.json`.
(The profiler slows the CPU side down: compare wall times between steps, not with the bench's TPOT.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import minirt
from minirt.bench import bench, build_random_qwen3, free_memory, make_prompts, report_header, write_report
from minirt.kernels import pdl_missing
from minirt.metrics import format_table

#: The settings of the first step: every optimization off.
_OFF = dict(attention_backend="torch", split_kv=False, enforce_eager=True, fused_ops=False, merge_projections=False,
            gemv=False, num_scheduler_steps=1, norm_in_gemv=False, rotary_kernel=False, pdl=False,
            kv_write_in_rotary=False, combine_in_attention=False, prefetch_kv=False, l2_prefetch=False,
            silu_and_mul_kernel=False, async_scheduling=False, rotary_cache=False, argmax_in_gemv=False)
#: (label, what the step changes in the settings of the step before it).
_CHANGES = [
    ("eager, torch attention", {}),
    ("+ Triton paged attention", {"attention_backend": "triton"}),
    ("+ CUDA graphs (decode)", {"enforce_eager": False}),
    ("+ fused ops (torch.compile)", {"fused_ops": True}),
    ("+ merged projections", {"merge_projections": True}),
    ("+ split-KV decode attention", {"split_kv": True}),
    ("+ Triton GEMV (batch 1)", {"gemv": True}),
    ("+ multi-step decode (8 steps)", {"num_scheduler_steps": 8}),
    ("+ norms in the GEMV prologue", {"norm_in_gemv": True}),
    ("+ one q/k rotary kernel", {"rotary_kernel": True}),
    ("+ programmatic dependent launch", {"pdl": True}),
    ("+ K/V write in the rotary kernel", {"kv_write_in_rotary": True}),
    ("+ K/V prefetch before the PDL wait", {"prefetch_kv": True}),
    ("+ next GEMV's weights into L2", {"l2_prefetch": True}),
    ("+ Triton SiLU-and-multiply", {"silu_and_mul_kernel": True}),
    ("+ async scheduling", {"async_scheduling": True}),
    ("+ cos and sin from tables", {"rotary_cache": True}),
    ("+ greedy argmax in the LM head", {"argmax_in_gemv": True}),
]


def _cumulative(changes: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(label, change) pairs -> (label, minirt.LLM settings): each step's change applied on the step before's."""
    settings, steps = _OFF, []
    for label, change in changes:
        settings = {**settings, **change}
        steps.append((label, settings))
    return steps


#: (label, minirt.LLM settings): each step adds one optimization to the one before.
STEPS = _cumulative(_CHANGES)


def kernels_of(prof) -> tuple[int, float, Counter]:
    """(number of kernels, their total duration in s, duration by kernel name) from a finished profile."""
    durations = Counter()
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            durations[e.name] += e.device_time * 1e-6   # microseconds
    return count, sum(durations.values()), durations


def profiled_run(llm, prompt: list[int], n: int) -> tuple[float, int, float, Counter]:
    params = minirt.SamplingParams(max_new_tokens=n, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return (wall, *kernels_of(prof))


def run_steps(device, model, steps, quick: bool, report: dict) -> None:
    """Bench each step (minirt only); prints the table of each step's figures and speed-ups over the first."""
    for label, kwargs in steps:
        r = bench(device, ["throughput", "latency"], quick, model, baselines=(), engine_kwargs=kwargs)
        report["steps"].append({"label": label, "engine": kwargs, "resolved": r["settings"]["engine_resolved"],
                                "correctness": r["correctness"], "bandwidth": r["bandwidth"],
                                "workloads": r["settings"]["workloads"],
                                "throughput": r["results"]["throughput"]["minirt"],
                                "latency": r["results"]["latency"]["minirt"]})
        free_memory()
        print(f"done: {label}", flush=True)
    first = report["steps"][0]
    rows = [[s["label"], s["throughput"]["output_tokens_per_s"],
             s["throughput"]["output_tokens_per_s"] / first["throughput"]["output_tokens_per_s"],
             s["latency"]["tpot_p50_s"] * 1e3, first["latency"]["tpot_p50_s"] / s["latency"]["tpot_p50_s"],
             s["latency"]["roofline_fraction"], s["correctness"]["exact_match"]] for s in report["steps"]]
    print(format_table(["step", "tok/s", "x first", "TPOT p50 ms", "x first", "roofline", "= transformers"], rows))


def profile_steps(device, model, steps, new_tokens: int, report: dict) -> None:
    """Profile batch-1 decode for each step: wall and kernel time per step, kernels per step, top kernels."""
    n = new_tokens
    for label, kwargs in steps:
        llm = minirt.LLM(model, device=device, dtype=torch.bfloat16, max_model_len=4096, **kwargs)
        prompts = make_prompts(3, (512, 512), llm.engine.model.config.vocab_size, seed=7)
        llm.generate([prompts[0]], minirt.SamplingParams(max_new_tokens=8, ignore_eos=True))   # warm-up
        w1, k1, t1, d1 = profiled_run(llm, prompts[1], 1)
        wn, kn, tn, dn = profiled_run(llm, prompts[2], n)
        per_kernel = {name: (dn[name] - d1.get(name, 0.0)) / (n - 1) for name in dn}
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:5]
        c = {"label": label, "engine": kwargs, "wall_per_step_s": (wn - w1) / (n - 1),
             "kernel_time_per_step_s": (tn - t1) / (n - 1), "kernels_per_step": (kn - k1) / (n - 1),
             "top_kernels": [{"name": name[:120], "time_per_step_s": t} for name, t in top]}
        report["configs"].append(c)
        print(f"{label:32s} wall {c['wall_per_step_s'] * 1e3:7.2f} ms/step  kernels "
              f"{c['kernel_time_per_step_s'] * 1e3:7.2f} ms/step  {c['kernels_per_step']:6.0f} kernels/step",
              flush=True)
        for name, t in top:
            print(f"    {t * 1e6:8.1f} us  {name[:100]}")
        del llm
        free_memory()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bench's --quick workloads")
    parser.add_argument("--profile", action="store_true", help="profile batch-1 decode steps instead")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps profiled (with --profile)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--steps", default=None,
                        help=f"comma-separated step numbers 0-{len(STEPS) - 1} to run (default: all)")
    args = parser.parse_args(argv)
    numbers = args.steps.split(",") if args.steps else [str(i) for i in range(len(STEPS))]
    if not all(n.isdigit() and int(n) < len(STEPS) for n in numbers):
        print(f"error: --steps: comma-separated step numbers 0-{len(STEPS) - 1}, got {args.steps!r}", file=sys.stderr)
        return 2
    chosen = [STEPS[int(n)] for n in numbers]
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device (the optimizations are GPU ones)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device("cuda")
    if missing := pdl_missing(device):          # before Hopper: the PDL step cannot run; the others still do
        skipped = [label for label, kwargs in chosen if kwargs.get("pdl")]
        chosen = [(label, kwargs) for label, kwargs in chosen if not kwargs.get("pdl")]
        for label in skipped:
            print(f"skipping step {label!r}: programmatic dependent launch needs {' and '.join(missing)}")
    report = report_header(device)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_qwen3(tmp, device, seed=0)
        if args.profile:
            report.update(prompt_len=512, new_tokens=args.new_tokens, configs=[])
            profile_steps(device, model, chosen, args.new_tokens, report)
            name = f"profile-decode-cuda-{datetime.date.today()}"
        else:
            report.update(quick=args.quick, steps=[])
            run_steps(device, model, chosen, args.quick, report)
            name = f"optimizations-cuda{'-quick' if args.quick else ''}-{datetime.date.today()}"
    write_report(report, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
