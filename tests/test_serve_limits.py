"""Limits on every connection (`minirt.serve.limits`): huge bodies, slow and silent sockets, the connection cap.

Oracles: the wall clock (another client's stream never pauses for long), the socket itself (the server closed
it: `recv` returns b"" or a reset), OpenAI's error JSON, and `LLM.generate` for the normal client's answer. The
server runs the embedded model on 127.0.0.1 (`BackgroundServer`), or as `python -m minirt serve` under a
256-descriptor limit. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import minirt
from minirt.serve.limits import ServerLimits
from minirt.serve.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[1]
MB10 = 10 * 2**20


def is_openai_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert not err["message"].startswith("None"), err
    return err


@pytest.fixture(scope="module")
def engine(default_model):
    return minirt.Engine(default_model, device="cpu", dtype="float32")


def stream_gaps(url: str, out: dict, max_tokens: int = 300) -> None:
    """Stream one long completion; record the arrival time of every chunk in out["times"]."""
    body = {"prompt": "ROMEO:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    times = out.setdefault("times", [])
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
    out["done"] = True


@pytest.mark.parametrize("max_body_bytes", [ServerLimits.max_body_bytes, 32 * 2**20], ids=["413", "400"])
def test_a_10mb_prompt_and_chat_message_do_not_pause_another_stream(engine, max_body_bytes):
    """Under the default body limit a 10 MB body is a 413; above it the prompt is refused by its length in
    characters before the tokenizer runs. Either way another client's stream goes on: no gap >= 0.5 s."""
    with BackgroundServer(engine, limits=ServerLimits(max_body_bytes=max_body_bytes)) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30)   # warm
        out: dict = {}
        t = threading.Thread(target=stream_gaps, args=(url, out), daemon=True)
        t.start()
        while len(out.get("times", ())) < 5:
            time.sleep(0.005)
        start = time.perf_counter()
        status = 413 if max_body_bytes < MB10 else 400
        with httpx.Client(base_url=url, timeout=60) as http:
            err = is_openai_error(http.post("/v1/completions", json={"prompt": "x" * MB10, "max_tokens": 4}), status)
            assert len(err["message"]) < 300
            chat = {"messages": [{"role": "user", "content": "y" * MB10}], "max_tokens": 4}
            is_openai_error(http.post("/v1/chat/completions", json=chat), status)
        end = time.perf_counter()
        t.join(60)
        assert out.get("done")
        during = [b - a for a, b in zip(out["times"], out["times"][1:]) if b > start and a < end]
        assert during and max(during) < 0.5, f"longest pause of the other stream: {max(during):.3f} s"


def test_a_body_over_the_limit_is_counted_as_it_streams(engine):
    """A chunked body (no Content-Length) is counted chunk by chunk; Content-Length over the limit is refused before
    the body is read, and the connection stays usable (the rest is read and dropped)."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 50_000
        yield b'"}'

    with BackgroundServer(engine, limits=ServerLimits(max_body_bytes=2**20)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        err = is_openai_error(http.post("/v1/completions", content=chunks(),
                                        headers={"content-type": "application/json"}), 413)
        assert "max_body_bytes = 1048576" in err["message"]
        is_openai_error(http.post("/v1/completions", json={"prompt": "z" * (2 * 2**20)}), 413)
        r = http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200                                   # same pooled connection, still served


def _closed_by_server(sock: socket.socket, within_s: float) -> tuple[bool, bytes]:
    """Read until the server closes (True, what it sent) or `within_s` passes (False, ...)."""
    sock.settimeout(0.05)
    data, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, data
        if not chunk:
            return True, data
        data += chunk
    return False, data


def open_hostile(url: str, n: int) -> list[tuple[str, socket.socket]]:
    """n sockets, in turn: silent, a head sent by halves and never finished, a head with a body never finished."""
    host, port = url.split("//")[1].split(":")
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)))
        kind = ("silent", "slow_head", "slow_body")[i % 3]
        if kind == "slow_head":
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        elif kind == "slow_body":
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        socks.append((kind, s))
    return socks


@pytest.mark.parametrize("max_connections", [50, 1000])
def test_300_idle_and_slow_sockets_do_not_lock_out_a_client_and_are_closed_in_time(engine, max_connections):
    """300 silent, slow-head and slow-body sockets: a normal client is served at once (at the cap, the idlest
    connection makes room), and every hostile socket is closed within its timeout (+ a sweep + slack); those that
    had started a request get a 408 in OpenAI's shape."""
    limits = ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_timeout_s=1.0,
                          max_connections=max_connections)
    if max_connections + 350 > resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
        pytest.skip("this process may not open that many sockets")
    with BackgroundServer(engine, limits=limits) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30)   # warm
        socks = open_hostile(url, 300)
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0},
                       timeout=10)
        assert r.status_code == 200 and time.monotonic() - start < 5
        deadline = start + 1.0 + limits.sweep_s + 2.0
        answers = {}
        for kind, s in socks:
            closed, data = _closed_by_server(s, max(0.1, deadline - time.monotonic()))
            assert closed, f"a {kind} socket still open {time.monotonic() - start:.1f} s after it was opened"
            if data:
                answers.setdefault(kind, []).append(data)
            s.close()
        for kind in ("slow_head", "slow_body") if max_connections > 300 else ():
            assert len(answers.get(kind, ())) == 100
            head, _, body = answers[kind][0].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["type"] == "invalid_request_error"
        assert "silent" not in answers                               # nothing is sent to a socket that said nothing


def test_503_in_openai_shape_when_every_connection_is_busy(engine):
    """max_connections = 2 with two streams in flight: a third connection gets 503 with Retry-After, then closes;
    once the streams end, new clients are served."""
    with BackgroundServer(engine, limits=ServerLimits(max_connections=2)) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30)   # warm
        outs = [{}, {}]
        threads = [threading.Thread(target=stream_gaps, args=(url, o, 400), daemon=True) for o in outs]
        for t in threads:
            t.start()
        while any(len(o.get("times", ())) < 2 for o in outs):
            time.sleep(0.005)
        with httpx.Client(timeout=10) as http:
            r = http.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
        err = is_openai_error(r, 503)
        assert err["type"] == "server_error" and "max_connections = 2" in err["message"]
        assert r.headers["retry-after"] == "1"
        for t in threads:
            t.join(60)
        assert all(o.get("done") for o in outs)
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


def test_a_head_or_body_too_slow_gets_408_and_an_idle_keep_alive_closes(engine):
    limits = ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_timeout_s=0.5)
    with BackgroundServer(engine, limits=limits) as url:
        (_, head), (_, body) = open_hostile(url, 3)[1:]
        for s in (head, body):
            closed, data = _closed_by_server(s, 3.0)
            assert closed and data.startswith(b"HTTP/1.1 408")
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"].startswith("request ")
        with httpx.Client(base_url=url, timeout=10) as http:           # keep-alive: closed once idle 0.5 s
            assert http.get("/health").status_code == 200
            time.sleep(0.5 + limits.sweep_s + 0.5)
            assert http.get("/health").status_code == 200                 # a new connection, transparently


@pytest.mark.parametrize("max_connections", [None, 1000], ids=["default", "over-the-limit"])
def test_under_a_256_descriptor_limit_300_idle_sockets_neither_lock_out_nor_flood_the_log(tmp_path, max_connections):
    """`python -m minirt serve` with RLIMIT_NOFILE = 256. By default max_connections stays below the limit, so
    accept() never fails: 300 silent sockets are answered by making room, and a normal client is served. Set above
    the limit, accept() may fail for want of descriptors: the log says so at most once per 10 s, without a
    traceback, and the client is served once the silent sockets reach their header timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flags = ["--header-timeout", "30"] if max_connections is None else ["--header-timeout", "3", "--max-connections",
                                                                         str(max_connections)]
    proc = subprocess.Popen([sys.executable, "-m", "minirt", "serve", "--port", str(port), "--device", "cpu", *flags],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    url = f"http://127.0.0.1:{port}"
    socks = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "serve.log").read()
            time.sleep(0.2)
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=20)
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(60)
    text = open(tmp_path / "serve.log").read()
    assert "Traceback" not in text and text.count("\n") < 50, text[-3000:]
    if max_connections is None:
        assert "cannot accept connections" not in text, text[-3000:]
