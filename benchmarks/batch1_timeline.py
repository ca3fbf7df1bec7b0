"""The kernels of a batch-1 decode step on the GPU's clock: what runs between two steps' layers, and for how long.

    python benchmarks/batch1_timeline.py [--new-tokens 48] [--out benchmarks/results]

Builds the `minirt.LLM` of `ab.py` (default plan, bfloat16) on the random Qwen3-0.6B-shaped checkpoint, warms it up,
then generates once (512-token prompt) under `torch.profiler` with CUDA activity. Kernels launched from a CUDA graph
are recorded one by one. A step is cut at each greedy argmax (torch's `ArgMax` kernel, or `_argmax_finish_kernel` where
the argmax is in the LM head's GEMV, argmax_in_gemv); for the last three
complete steps it lists every kernel that is not one of the 28 layers' repeated kernels in order, with its start
against the step's first kernel, its duration and the gap since the kernel before it ended (negative where
programmatic dependent launch overlaps them), and sums each kernel name's time per step; and for each kernel of a
layer, how much later it ends than the one before it, the median over the inner layers. With PDL the kernels
overlap, so durations do not add up to the step: `batch1_ablation.py` times what a kernel costs on the step's path.
Writes `batch1-timeline-cuda-<date>.json`. Needs CUDA.
"""

from __future__ import annotations

import collections
import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from ab import new_llm  # noqa: E402
from minirt.bench import build_random_qwen3, make_prompts, report_header, run_minirt, write_report  # noqa: E402
from harness import cuda_script_args  # noqa: E402

LAYERS = 28


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every CUDA kernel in `prof`, by start."""
    out = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
           and "memset" not in e.name.lower()]
    return sorted(out, key=lambda k: k[1])


def steps_of(kernels: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """The kernels cut after each argmax: one list per step (the last, unfinished one dropped)."""
    steps, current = [], []
    for k in kernels:
        current.append(k)
        if "ArgMax" in k[0] or "_argmax_finish" in k[0]:
            steps.append(current)
            current = []
    return steps


def describe(step: list[tuple[str, float, float]]) -> dict:
    t0 = step[0][1]
    counts = collections.Counter(name for name, _, _ in step)
    rows, prev_end = [], t0
    for name, start, end in step:
        if counts[name] < LAYERS:                      # not a per-layer kernel
            rows.append({"name": name[:100], "start_us": start - t0, "dur_us": end - start,
                         "gap_us": start - prev_end})
        prev_end = end
    by_name, calls = collections.defaultdict(float), collections.Counter()
    for name, start, end in step:
        by_name[name[:100]] += end - start
        calls[name[:100]] += 1
    return {"span_us": step[-1][2] - t0, "kernels": len(step), "per_step_kernels": rows,
            "per_name": [{"name": n, "count": calls[n], "us": us}
                         for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])]}


LAYER_PARTS = ("qkv_proj", "rotary", "attention", "combine", "o_proj", "gate_up_proj", "down_proj")


def layer_increments(step: list[tuple[str, float, float]]) -> dict:
    """Per part of a layer (LAYER_PARTS: the kernels between one rotary kernel's GEMV and the next's), the median
    over the step's inner layers of how much later it ends than the kernel before it (its cost on the step's
    path, as far as the profiler's clock shows it) and how long before that kernel's end it started (its head start
    under PDL). Empty when the step's kernels are not that sequence (another plan)."""
    rotary = [i for i, (name, _, _) in enumerate(step) if "rotate" in name]
    layers = [step[r - 1:r - 1 + len(LAYER_PARTS)] for r in rotary[1:-1] if r >= 1]
    if not layers or any(len(layer) != len(LAYER_PARTS) for layer in layers):
        return {}
    out = {}
    for j, part in enumerate(LAYER_PARTS):
        ends, leads = [], []
        for i, layer in enumerate(layers):
            before = layer[j - 1] if j else step[rotary[i + 1] - 2]      # down_proj of the layer before
            ends.append(layer[j][2] - before[2])
            leads.append(before[2] - layer[j][1])
        out[part] = {"end_after_previous_us": statistics.median(ends), "started_before_previous_end_us":
                     statistics.median(leads), "kernel": layer[j][0][:60]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--new-tokens",), {"type": int, "default": 48}))
    if args is None:
        return 2
    device = torch.device("cuda")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        llm = new_llm(build_random_qwen3(tmp, device, seed=0), device)
        prompts = make_prompts(2, (512, 512), llm.engine.model.config.vocab_size, seed=3)
        run_minirt(llm, prompts[:1], 16, device)           # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fig, _ = run_minirt(llm, prompts[1:], args.new_tokens, device)
    steps = steps_of(kernel_events(prof))
    last = [describe(s) for s in steps[-4:-1]]
    for i, d in enumerate(last):
        print(f"step -{3 - i}: {d['kernels']} kernels over {d['span_us']:.1f} us; kernels outside the layers:")
        for r in d["per_step_kernels"]:
            print(f"  +{r['start_us']:8.1f} us  {r['dur_us']:6.1f} us  gap {r['gap_us']:6.1f}  {r['name'][:80]}")
    increments = layer_increments(steps[-2]) if len(steps) > 1 else {}
    print("a layer's kernels, median over the last step's inner layers (end after the kernel before; head start):")
    for part, r in increments.items():
        print(f"  {part:14s} +{r['end_after_previous_us']:5.2f} us   started {r['started_before_previous_end_us']:5.2f} "
              f"us before  ({r['kernel']})")
    print("time per kernel name, last step:")
    for r in last[-1]["per_name"][:20]:
        print(f"  {r['us']:8.1f} us  x{r['count']}  {r['name'][:90]}")
    report = {**report_header(device), "tpot_p50_s": fig["tpot_p50_s"], "steps_seen": len(steps), "last_steps": last,
              "layer_increments": increments,
              "plan": llm.engine.plan.as_dict()}
    write_report(report, args.out, f"batch1-timeline-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
