#!/usr/bin/env python3
"""How many CPU threads `python -m minirt demo` and `generate` should use for the embedded model.

    python benchmarks/cpu_threads.py [--repeats 3] [--threads 1,2] [--out benchmarks/results/cpu/threads.json]

Runs the two commands exactly as a user types them (`--threads N`, the embedded model, a fresh interpreter per
run), N interleaved over the repeats so that a change in the machine's load hits every N alike, and records per
run the wall time of the whole command (start-up and model load included: what a user waits for), TTFT, TPOT
and, for `demo`, its output tokens per second, parsed from what the command prints. Writes JSON with the commit,
the CPU, the load average before and after, and per N the median of each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = {
    "generate": ["generate", "ROMEO:", "--max-new-tokens", "64"],
    "demo": ["demo"],
}
NUMBER = r"([0-9.]+(?:e-?[0-9]+)?)"


def parse(command: str, text: str) -> dict:
    """TTFT/TPOT (s) and, for demo, output tokens per second, from the command's own summary line."""
    if command == "generate":
        m = re.search(rf"TTFT {NUMBER} s, TPOT {NUMBER} s", text)
        return {"ttft_s": float(m.group(1)), "tpot_s": float(m.group(2))}
    m = re.search(rf"= {NUMBER} tok/s; TTFT p50 {NUMBER} s, TPOT p50 {NUMBER} s", text)
    return {"output_tokens_per_s": float(m.group(1)), "ttft_p50_s": float(m.group(2)), "tpot_p50_s": float(m.group(3))}


def run_once(command: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)             # only --threads decides
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "minirt", *COMMANDS[command], "--threads", str(threads)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{command} --threads {threads} failed:\n{proc.stderr[-2000:]}")
    return {"wall_s": round(wall, 3), **parse(command, proc.stdout + proc.stderr)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from minirt.bench import report_header

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default=",".join(str(n) for n in range(1, (os.cpu_count() or 1) + 1)),
                   help="comma-separated thread counts (default: 1 .. the number of cores)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "threads.json")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]

    report = report_header(torch.device("cpu"))
    report["cpu_count"] = os.cpu_count()
    report["load_average_1min_before"] = os.getloadavg()[0]
    runs = {c: {n: [] for n in counts} for c in COMMANDS}
    for r in range(args.repeats):
        for command in COMMANDS:
            for n in counts:
                result = run_once(command, n)
                runs[command][n].append(result)
                print(f"repeat {r}: {command} --threads {n}: {result}", flush=True)
    report["load_average_1min_after"] = os.getloadavg()[0]
    report["settings"] = {"repeats": args.repeats, "threads": counts, "commands": COMMANDS}
    report["results"] = {
        command: {str(n): {"median": {k: statistics.median(x[k] for x in rs) for k in rs[0]}, "runs": rs}
                  for n, rs in per.items()}
        for command, per in runs.items()}
    fastest = {command: min(per, key=lambda n: statistics.median(x["tpot_s" if command == "generate" else "tpot_p50_s"]
                                                                 for x in per[n]))
               for command, per in runs.items()}
    report["fastest_threads_by_tpot"] = fastest
    report["note"] = ("Each run is a fresh `python -m minirt <command> --threads N` on the embedded model; wall_s is "
                      "the whole command (interpreter start, imports, model load, generation). The machine was "
                      "shared with other work: see the load averages.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"fastest by TPOT: {fastest}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
