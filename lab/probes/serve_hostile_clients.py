"""How much hostile traffic disturbs another client of `python -m minirt serve` (CPU, embedded model).

One client streams a long completion; meanwhile a 10 MB prompt, then a 10 MB chat message, are posted: the
figure is the other stream's longest pause between two chunks while each is answered. Then 300 silent sockets are
opened: how long a normal request takes, and how many of the 300 are still open 12 s later. The server runs on a
thread of this process with its default settings (`BackgroundServer`), so the probe runs on any tree that has one:

    python lab/probes/serve_hostile_clients.py                      # this tree
    PYTHONPATH=/tmp/old python lab/probes/serve_hostile_clients.py --tree /tmp/old --out ...   # another
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream(url: str, out: list) -> None:
    import httpx

    body = {"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(time.perf_counter())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=ROOT, help="the source tree measured (its git commit is recorded)")
    p.add_argument("--out", default=os.path.join(ROOT, "lab/results/serve-hostile-clients/cpu.json"))
    args = p.parse_args()
    if args.tree not in sys.path:
        sys.path.insert(0, args.tree)
    import httpx

    import minirt
    from minirt.serve.server import BackgroundServer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.tree, capture_output=True,
                            text=True).stdout.strip() or os.path.basename(args.tree)
    result = {"tree": minirt.__file__, "commit": commit, "cpu_count": os.cpu_count()}
    engine = minirt.Engine(device="cpu")
    with BackgroundServer(engine) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30)   # warm
        for what in ("prompt", "chat"):
            times: list = []
            t = threading.Thread(target=stream, args=(url, times))
            t.start()
            while len(times) < 5:
                time.sleep(0.005)
            start = time.perf_counter()
            if what == "prompt":
                r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 10_000_000, "max_tokens": 4}, timeout=300)
            else:
                r = httpx.post(url + "/v1/chat/completions", timeout=300,
                               json={"messages": [{"role": "user", "content": "y" * 10_000_000}], "max_tokens": 4})
            end = time.perf_counter()
            t.join()
            gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
            result[f"10mb_{what}"] = {"status": r.status_code, "answered_s": round(end - start, 3),
                                      "other_stream_longest_pause_s": round(max(gaps), 3) if gaps else None}
            print(what, result[f"10mb_{what}"], flush=True)
        host, port = url.split("//")[1].split(":")
        socks = [socket.create_connection((host, int(port))) for _ in range(300)]
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=30)
        result["300_silent_sockets"] = {"normal_client_status": r.status_code,
                                        "normal_client_s": round(time.perf_counter() - t0, 3)}
        time.sleep(12)
        alive = 0
        for s in socks:
            s.settimeout(0.01)
            try:
                alive += s.recv(10) != b""
            except socket.timeout:
                alive += 1
            except OSError:
                pass
            s.close()
        result["300_silent_sockets"]["still_open_after_12_s"] = alive
        print(result["300_silent_sockets"], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
