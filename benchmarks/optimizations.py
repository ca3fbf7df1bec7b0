"""What each GPU optimization buys: minirt alone, the optimizations of chapter 07 turned on one by one.

    python benchmarks/optimizations.py [--quick] [--steps 0,2,5] [--out benchmarks/results]
    python benchmarks/optimizations.py --profile [--new-tokens 64] [--steps ...]

Runs the `python -m minirt bench` workloads (see `minirt/bench.py`) on the same random Qwen3-0.6B-shaped
checkpoint for each step of `STEPS`, derived from `minirt.fast.plan.RULES`: the reference engine first, then each
switch the engine turns on by default on a Hopper GPU, in the table's order, one per step (each step's resolved plan
differs from the one before in exactly that switch). transformers runs only as the correctness guard (4 prompts x 32 greedy tokens each step).
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
import dataclasses
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
from minirt.config import EngineConfig
from minirt.fast import Hardware, resolve_plan
from minirt.fast.plan import RULES, Plan
from minirt.kernels import pdl_missing
from minirt.metrics import format_table

#: How a step names the switch it turns on, by `RULES` row (a row not named here is labelled by its `Rule.what`).
LABELS = {
    "attention_backend": "+ Triton paged attention", "split_kv": "+ split-KV decode attention",
    "cuda_graphs": "+ CUDA graphs (decode)", "fused_ops": "+ fused ops (torch.compile)",
    "merge_projections": "+ merged projections", "gemv": "+ Triton GEMV (batch 1)",
    "num_scheduler_steps": "+ multi-step decode (8 steps)", "norm_in_gemv": "+ norms in the GEMV prologue",
    "rotary_kernel": "+ one q/k rotary kernel", "pdl": "+ programmatic dependent launch",
    "kv_write_in_rotary": "+ K/V write in the rotary kernel", "prefetch_kv": "+ K/V prefetch before the PDL wait",
    "l2_prefetch": "+ next GEMV's weights into L2", "overlap_scheduling": "+ overlap scheduling (bursts)",
    "piecewise_graphs": "+ piecewise CUDA graphs (prefill)", "async_scheduling": "+ async scheduling",
    "silu_and_mul_kernel": "+ Triton SiLU-and-multiply", "rotary_cache": "+ cos and sin from tables",
    "argmax_in_gemv": "+ greedy argmax in the LM head",
}
#: A switch's `EngineConfig` value for off and for on, where it is not False and True.
_OFF_VALUE = {"attention_backend": "torch", "enforce_eager": True, "num_scheduler_steps": 1, "speculative": None,
              "num_speculative_tokens": None}
_ON_VALUE = {"attention_backend": "triton", "enforce_eager": False, "num_scheduler_steps": 8}
#: Switches that need programmatic dependent launch (a Hopper GPU): left out of the steps on an older one.
NEEDS_PDL = ("pdl", "prefetch_kv", "l2_prefetch")


def build_steps(leave_out: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(label, minirt.LLM settings) per step, derived from `minirt.fast.plan.RULES`: the first step with every switch
    off (the reference engine), then, in `RULES` order, each switch the default plan of a CUDA Hopper GPU runs turned
    on by name, one per step, so that consecutive steps' resolved plans differ in exactly that switch. The last step
    resolves as the engine's defaults do there. `leave_out`: `Plan` fields kept off (and not a step)."""
    default = resolve_plan(EngineConfig(), torch.device("cuda"), hardware=Hardware("cuda"))
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    rows = [rule for rule in RULES if rule.name in plan_fields]         # the flash_attn row has no field of its own
    settings = {rule.config_field(): _OFF_VALUE.get(rule.config_field(), False) for rule in rows}
    steps = [("reference: every switch off", dict(settings))]
    for rule in rows:
        if getattr(default, rule.name) == getattr(Plan(), rule.name) or rule.name in leave_out:
            continue                                                    # off by default (combine_in_attention)
        settings[rule.config_field()] = _ON_VALUE.get(rule.config_field(), True)
        steps.append((LABELS.get(rule.name, "+ " + rule.what), dict(settings)))
    return steps


#: (label, minirt.LLM settings): each step turns on one more switch of the resolved plan than the one before.
STEPS = build_steps()


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
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device (the optimizations are GPU ones)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device("cuda")
    steps = STEPS
    if missing := pdl_missing(device):          # before Hopper: the PDL steps cannot run; the others still do
        steps = build_steps(leave_out=NEEDS_PDL)
        print(f"leaving out {', '.join(NEEDS_PDL)}: programmatic dependent launch needs {' and '.join(missing)}; "
              f"steps renumbered 0-{len(steps) - 1}")
    chosen = [steps[int(n)] for n in numbers if int(n) < len(steps)]
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
