"""The floor under the GEMV chain's dependencies: one flagged word between two SMs, and every block's words to every
block, idle and under a memory stream (`sync_floor.cu`; lab/pages/sync-floor.md).

    python lab/probes/sync_floor.py [--rounds 2000] [--out lab/results/sync-floor]

The persistent GEMV chain (`lab.kernels.gemv_chain_cuda`) pays 2.4-2.7 us per product for the wait on the product
before (lab/pages/gemv-chain.md), four times a layer, against 7.5 us a layer for the weights at the copy
bandwidth. This asks what the wait costs with nothing else in it: one block per SM; `ping-pong` passes a word from
block 0 to the last block and back (a round trip per round), `all-gather` has every block write one 128-byte line of
words and then wait, with 256 threads polling 16-byte loads, for every block's line (one product's dependency per
round, without the product), `counter` has every block write its line, count itself in on one counter and wait
for the count before it loads every line (a grid barrier, then the input). Each with the other 256 threads of every
block idle, or streaming a 1 GiB buffer with 16-byte loads that skip L1 (as the chain's weight stream keeps L2 and
memory busy). Prints microseconds per round and the stream's bandwidth, and writes `sync-floor-cuda-<date>.json`.
Needs CUDA and nvcc.
"""

from __future__ import annotations

import ctypes
import datetime
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]     # the repository root (minirt, lab) and harness
from harness import cuda_script_args  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402
from minirt.kernels import num_sms  # noqa: E402
from lab.kernels.nvcc_build import build_library  # noqa: E402
from minirt.metrics import format_table  # noqa: E402

SOURCE = Path(__file__).with_name("sync_floor.cu")
MODES = {"ping-pong": 0, "all-gather": 1, "counter": 2}
STREAM_BYTES = 1 << 30
LINE = 32


def library() -> ctypes.CDLL:
    lib = build_library(SOURCE, ["-O3", "-arch=sm_90", "-std=c++17"], "sync_floor")
    lib.minirt_sync_floor.restype = ctypes.c_int
    lib.minirt_sync_floor.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_ulonglong] + \
        [ctypes.c_void_p] * 2
    return lib


def run(lib, mode: str, rounds: int, stream: torch.Tensor | None, device: torch.device, grid: int) -> dict:
    """One launch: µs per round (block 0's), and the stream's GB/s over that time."""
    words = torch.zeros(grid * LINE + 64, dtype=torch.int32, device=device)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    err = lib.minirt_sync_floor(MODES[mode], grid, rounds, words.data_ptr(), words[grid * LINE:].data_ptr(),
                                None if stream is None else stream.data_ptr(),
                                0 if stream is None else stream.numel() // 16, out.data_ptr(),
                                torch.cuda.current_stream(device).cuda_stream)
    if err == -1:
        raise RuntimeError(f"sync_floor: {grid} blocks cannot all be resident at once, or rounds {rounds} is not in "
                           "1..65535 (a word holds the round in 16 bits)")
    if err:
        raise RuntimeError(f"sync_floor launch failed: CUDA error {err}")
    torch.cuda.synchronize(device)
    ns, loaded, stale = out[0].item(), out[1].item(), out[2].item()
    if stale:
        raise RuntimeError(f"sync_floor {mode}: {stale} loads after the count read a word of an earlier round")
    return {"us_per_round": ns / rounds / 1e3, "stream_gb_s": loaded / ns if stream is not None else None}


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--rounds",), {"type": int, "default": 2000}),
                            (("--repeats",), {"type": int, "default": 5}),
                            out_dir=str(REPO / "lab" / "results" / "sync-floor"))
    if args is None:
        return 2
    if not 1 <= args.rounds <= 65535 or args.repeats < 1:
        print(f"error: --rounds: must be 1..65535 (got {args.rounds}); --repeats >= 1 (got {args.repeats})",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    lib = library()
    grid = num_sms(device)
    stream = torch.randint(0, 255, (STREAM_BYTES,), dtype=torch.uint8, device=device)
    results, rows = {}, []
    for mode in MODES:
        for streaming in (False, True):
            runs = [run(lib, mode, args.rounds, stream if streaming else None, device, grid)
                    for _ in range(args.repeats + 1)][1:]
            us = statistics.median(r["us_per_round"] for r in runs)
            gbs = statistics.median(r["stream_gb_s"] for r in runs) if streaming else None
            name = f"{mode}, {'stream' if streaming else 'idle'}"
            results[name] = {"us_per_round": us, "stream_gb_s": gbs, "runs": runs}
            rows.append([name, us, "" if gbs is None else f"{gbs:.0f}"])
    print(format_table(["", "us per round", "stream GB/s"], rows))
    report = {**report_header(device), "grid": grid, "rounds": args.rounds, "stream_bytes": STREAM_BYTES,
              "results": results}
    write_report(report, args.out, f"sync-floor-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
