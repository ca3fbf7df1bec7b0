"""GET /health latency while 200 streams run, in each of the server's modes (`--in-process` and the split).

    python lab/probes/serve_health_under_load.py [--out FILE]     # default lab/results/serve-health-under-load/cpu.json

Same method as tests/test_serve_split.py: the embedded model on the CPU (`--threads 1`), 200 streams of 250
tokens from a lean raw-socket client in its own process, then 40 probes on a keep-alive connection, 20 ms apart.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_serve import _env, _serve_cmd, _wait_health  # noqa: E402
from test_serve_split import LOAD, health_latencies  # noqa: E402

from minirt.parallel.workers import free_port  # noqa: E402


def measure(extra: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_serve_cmd(port, "--threads", "1", *extra), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_health(proc, url, 180)
        times, running = health_latencies(url, [sys.executable, "-c", LOAD, "127.0.0.1", str(port), "200", "250"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
            "max_ms": max(times) * 1e3, "running_at_last_probe": running, "probes_ms": [t * 1e3 for t in times]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "lab/results/serve-health-under-load/cpu.json"))
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"what": "GET /health latency while 200 streams run (embedded model, CPU, --threads 1)",
              "commit": commit, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "split": measure([]), "in_process": measure(["--in-process"])}
    for mode in ("split", "in_process"):
        r = result[mode]
        print(f"{mode:10s} median {r['median_ms']:.1f} ms  p90 {r['p90_ms']:.1f} ms  max {r['max_ms']:.1f} ms  "
              f"running {r['running_at_last_probe']:.0f}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
