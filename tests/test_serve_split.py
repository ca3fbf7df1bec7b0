"""The split server: engine core and HTTP front end(s) in separate processes (`minirt.serve.core`, `.client`).

Oracles: the bounds the design exists for (GET /health answered within 50 ms at the median while 200 streams
run, the front end never blocked by a step), the kernel's own view of which process accepts a connection
(a stopped front end accepts nothing), the core process's death made by the test itself, and the tokens the
client received (the counters must have counted at least those while the request still runs). The equality
with `LLM.generate` in both modes is tests/test_serve.py's, run over both modes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from minirt.engine import Engine
from minirt.serve.client import EngineClient
from minirt.serve.core import start_engine_core
from minirt.serve.server import BackgroundServer
from test_serve import MODES, ROOT, _env, _serve_cmd, _wait_health, metric, running_server, sse_payloads, wait_idle

#: 200 streams over raw sockets, from their own process (a lean client: it must not be the bottleneck, nor share
#: the measuring process's interpreter). Prints "started" once every stream has its first event, then reads on.
LOAD = r"""
import asyncio, json, sys
host, port, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
async def one(i, first):
    r, w = await asyncio.open_connection(host, port)
    body = json.dumps({"prompt": f"ROMEO {i}:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)
    while b"data:" not in await r.readline():
        pass
    first.release()
    while await r.read(65536):
        pass
async def main():
    first = asyncio.Semaphore(0)
    tasks = [asyncio.create_task(one(i, first)) for i in range(n)]
    for _ in range(n):
        await first.acquire()
    print("started", flush=True)
    await asyncio.gather(*tasks)
asyncio.run(main())
"""


def health_latencies(url: str, load_cmd: list[str], num_probes: int = 40) -> tuple[list[float], float]:
    """Start the load, wait until every stream has its first event, then time `num_probes` GET /health on a
    keep-alive connection, 20 ms apart; returns (seconds per probe, requests running at the last probe)."""
    load = subprocess.Popen(load_cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert load.stdout.readline().strip() == "started", "the load never started"
        times = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(num_probes):
                t0 = time.perf_counter()
                assert http.get("/health").status_code == 200
                times.append(time.perf_counter() - t0)
                time.sleep(0.02)
            running = metric(url, "minirt:num_requests_running")
        return times, running
    finally:
        load.kill()                     # a disconnect storm: every stream is aborted
        load.wait()


def test_health_answers_within_50ms_at_the_median_while_200_streams_run():
    from minirt.parallel.workers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_serve_cmd(port, "--threads", "1"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_health(proc, url, 180)
        times, running = health_latencies(url, [sys.executable, "-c", LOAD, "127.0.0.1", str(port), "200", "250"])
        assert running == 200, "the streams ended before the probes did: the bound was not measured under load"
        median = statistics.median(times)
        assert median < 0.050, f"/health median {median * 1e3:.1f} ms under 200 streams (max {max(times) * 1e3:.0f})"
        deadline = time.monotonic() + 60          # the aborted streams free their blocks
        while metric(url, "minirt:kv_blocks_used") > 0:
            assert time.monotonic() < deadline, "blocks still held after the clients went away"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_front_ends_both_serve_and_share_their_counters():
    from minirt.parallel.workers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_serve_cmd(port, "--api-server-count", "2", "--max-body-bytes", "4096"), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    body = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    try:
        _wait_health(proc, url, 180)                 # three interpreters start, on a shared CPU
        line = ""
        while "front ends pids" not in line:      # printed before the front ends listen: read it from stderr
            line = proc.stderr.readline()
            assert line, "the server never named its front ends"
        pids = [int(p) for p in re.findall(r"\d+", line.split("front ends pids")[1].split("]")[0])]
        assert len(pids) == 2
        texts = []
        for stopped, serving in (pids, pids[::-1]):   # a stopped process accepts nothing: the other one must
            os.kill(stopped, signal.SIGSTOP)
            try:
                r = httpx.post(url + "/v1/completions", json=body, timeout=30)   # a new connection each time
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            finally:
                os.kill(stopped, signal.SIGCONT)
        assert texts[0] == texts[1]                    # greedy, one engine core
        # the limits and the engine's own checks hold in the front-end processes too
        big = httpx.post(url + "/v1/completions", json={**body, "prompt": "x" * 8192}, timeout=30)
        assert big.status_code == 413 and "4096" in big.json()["error"]["message"], big.text
        bad = httpx.post(url + "/v1/completions", content=json.dumps({**body, "prompt": "a\ud800b"}),
                         headers={"content-type": "application/json"}, timeout=30)     # JSON's \ud800 escape
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        for _ in range(4):                             # whichever front end answers, it counts both requests
            assert metric(url, "minirt:request_success_total", "finished_reason=length") == 2
            assert metric(url, "minirt:generation_tokens_total") == 8
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_core_death_ends_streams_with_an_error_and_health_with_503(default_model):
    core = start_engine_core(default_model, {"device": "cpu", "dtype": "float32"}, threads=1)
    long = {"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    try:
        with BackgroundServer(EngineClient(core.address, core.info)) as url, httpx.Client(base_url=url,
                                                                                          timeout=30) as http:
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                core.popen.kill()
                payloads = sse_payloads(type("R", (), {"iter_lines": lambda self: lines})())
            assert payloads[-1] == "[DONE]" and "engine core process is gone" in payloads[-2]["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            refused = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_error"
    finally:
        core.stop()


@pytest.mark.parametrize("mode", MODES)
def test_token_counters_move_per_step_while_the_request_runs(default_model, mode):
    with running_server(mode, default_model) as (url, engine), httpx.Client(base_url=url, timeout=30) as http:
        prompt_tokens = len(engine.tokenizer.encode("ROMEO:"))
        body = {"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            seen = []
            for _ in range(2):
                chunks = 0
                while chunks < 5:                         # each chunk carries at least one new token
                    chunks += next(lines).startswith("data: ")
                seen.append(metric(url, "minirt:generation_tokens_total"))
                assert seen[-1] >= 5 * len(seen)
                assert metric(url, "minirt:prompt_tokens_total") == prompt_tokens
                assert metric(url, "minirt:e2e_request_latency_seconds_count") == 0     # still running
            assert seen[1] > seen[0]
        wait_idle(engine)
        assert metric(url, "minirt:request_success_total", "finished_reason=abort") == 1


def test_the_front_end_validates_with_the_engines_own_function():
    assert EngineClient.validate is Engine.validate and EngineClient._tokenize is Engine._tokenize
    assert EngineClient.encode is Engine.encode and EngineClient.max_prompt_chars is Engine.max_prompt_chars


def test_a_front_end_started_after_the_core_died_answers_503(default_model):
    core = start_engine_core(default_model, {"device": "cpu", "dtype": "float32"}, threads=1)
    core.popen.kill()
    core.popen.wait()
    try:
        with BackgroundServer(EngineClient(core.address, core.info)) as url, httpx.Client(base_url=url,
                                                                                          timeout=30) as http:
            deadline = time.monotonic() + 10       # the first connection attempt is refused within zmq's retry
            while (health := http.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "a front end without an engine core still says it is healthy"
                time.sleep(0.05)
            assert health.status_code == 503 and "nothing listens" in health.json()["reason"]
            assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 503
    finally:
        core.stop()


@pytest.mark.parametrize("mode", MODES)
def test_ttft_counts_from_the_arrival_at_the_front_end(default_model, mode):
    """Headers first, the body 0.5 s later: the request arrived when its headers did, so the server's TTFT includes
    the wait for the body (as it includes parsing, tokenizing and the queue), whatever the engine's clock says."""
    import socket

    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}).encode()
    with running_server(mode, default_model) as (url, engine):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            time.sleep(0.5)
            sock.sendall(body)
            answer = b""
            while b'"usage"' not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        assert metric(url, "minirt:time_to_first_token_seconds_count") == 1
        assert metric(url, "minirt:time_to_first_token_seconds_sum") >= 0.5
        assert metric(url, "minirt:e2e_request_latency_seconds_sum") >= 0.5
