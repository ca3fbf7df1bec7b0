"""The launch floor of a decode step: as many empty Triton kernels as the step runs, in one CUDA graph.

A batch-1 decode step of the Qwen3-0.6B shape runs 219 kernels (chapter 07's profile, run 5). Each kernel here
does only what every minirt kernel does at its start with programmatic dependent launch (PDL): let the next
kernel launch, then wait for the one before (`gdc_launch_dependents`, `gdc_wait`); program 0 adds 1 to a
counter, so the chain has a real dependency. It runs with 1, 128 and 1024 programs (minirt's combine and
rotary kernels have tens, its attention 128 at batch 1, its GEMVs 512 to 1024), launched without and with PDL,
captured once and replayed. The time per replay is what starting and retiring that many kernels costs before
any byte of weights is read: a floor under the step time that no tuning of one kernel removes.
Prints a table and writes `launch-floor-cuda-<date>.json` to --out (default `benchmarks/results`).

    python benchmarks/launch_floor.py [--kernels 219] [--replays 200] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minirt.bench import report_header, write_report  # noqa: E402
from minirt.metrics import format_table  # noqa: E402

GRIDS = (1, 128, 1024)


def floor_us(kernel, num_kernels: int, grid: int, pdl: bool, replays: int) -> float:
    """Microseconds per replay of a CUDA graph of `num_kernels` launches of `kernel` with `grid` programs."""
    x = torch.zeros(1, device="cuda")
    launch = {"launch_pdl": True} if pdl else {}
    kernel[(grid,)](x, PDL=pdl, **launch)                  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(num_kernels):
            kernel[(grid,)](x, PDL=pdl, **launch)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=219, help="kernels per graph (default 219: a batch-1 step)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    for name in ("kernels", "replays"):
        if getattr(args, name) < 1:
            print(f"error: --{name}: must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("error: the launch-floor benchmark needs a CUDA device", file=sys.stderr)
        return 2
    from minirt.kernels import pdl_missing

    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(X, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if tl.program_id(0) == 0:
            tl.store(X, tl.load(X) + 1)

    device = torch.device("cuda")
    modes = [False] if pdl_missing(device) else [False, True]
    rows, results = [], []
    for grid in GRIDS:
        for pdl in modes:
            us = floor_us(empty_kernel, args.kernels, grid, pdl, args.replays)
            results.append({"programs": grid, "pdl": pdl, "us_per_graph": us, "us_per_kernel": us / args.kernels})
            rows.append([grid, "on" if pdl else "off", us, us / args.kernels])
    print(format_table(["programs", "PDL", "us per graph", "us per kernel"], rows))
    write_report({**report_header(device), "kernels_per_graph": args.kernels, "replays": args.replays, "results": results},
                 args.out, f"launch-floor-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
