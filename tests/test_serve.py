"""The OpenAI-compatible server (`minirt.serve`), through the official `openai` client and raw HTTP.

Oracle: `minirt.LLM.generate` on the same prompts and sampling parameters (itself checked against
transformers in test_equality.py), and the tokenizer's own chat template. The server runs the embedded model on
127.0.0.1 on a free port, in both of its modes: the front end on a thread of this process (`BackgroundServer`, so
the tests can read `engine.stats()`) over the `Engine` itself ("in-process") or over an `EngineClient` whose engine
core is a process of its own ("split"); or as `python -m minirt serve` in a subprocess for the signal and
load-failure tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

import minirt
from minirt.serve.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:", "To be, or not to be, that is", "KING HENRY:\nOnce more unto the breach"]
NAMES = ["ROMEO", "JULIET", "HAMLET", "OPHELIA", "MACBETH", "BANQUO", "LEAR", "CORDELIA", "OTHELLO", "IAGO"]


def wait_idle(engine, timeout_s: float = 10.0) -> dict:
    """engine.stats() once no request is in flight (read from the test's thread: plain ints, no lock needed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats()
        if not engine.requests and s["num_waiting"] + s["num_prefilling"] + s["num_running"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still in flight after {timeout_s} s: {s}")
        time.sleep(0.02)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of GET /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = dict(kv.split("=") for kv in labels.split(",")) if labels else {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                return s.value
    return 0.0


def sse_payloads(response) -> list:
    """The `data:` payloads of an SSE response (JSON decoded, "[DONE]" kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


MODES = ["in-process", "split"]
SERVER_SETTINGS = ("max_waiting", "shutdown_timeout")


@contextmanager
def running_server(mode: str, model, **settings):
    """(url, engine) of a server on a thread of this process: over an `Engine` ("in-process"), or over an
    `EngineClient` of an engine core started as its own process ("split"). `settings`: the engine's, and
    `SERVER_SETTINGS` for the server."""
    from minirt.serve.client import EngineClient
    from minirt.serve.core import start_engine_core

    served = {k: settings.pop(k) for k in SERVER_SETTINGS if k in settings}
    settings = {"device": "cpu", "dtype": "float32", **settings}
    core = None
    if mode == "in-process":
        engine = minirt.Engine(model, **settings)
    else:
        core = start_engine_core(model, settings, threads=int(os.environ.get("MINIRT_TEST_THREADS", "1")))
        engine = EngineClient(core.address, core.info)
    bg = BackgroundServer(engine, **served)
    try:
        yield bg.start(), engine
    finally:
        bg.stop()
        if core is not None:
            core.stop()


@pytest.fixture(scope="module", params=MODES)
def server(request, default_model):
    with running_server(request.param, default_model) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, engine=engine, client=client, model="default_model", mode=request.param)


def _params(**kw):
    return minirt.SamplingParams(**kw)


# ---------------------------------------------------------------------------------------------- equal to LLM


def test_completions_greedy_equal_llm_generate(server, default_llm):
    want = default_llm.generate(PROMPTS, _params(max_new_tokens=24))
    for prompt, w in zip(PROMPTS, want):
        r = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == w.text
        assert r.choices[0].finish_reason == w.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(w.prompt_token_ids), len(w.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.model == server.model
    ids = want[0].prompt_token_ids              # a prompt given as token ids
    r = server.client.completions.create(model=server.model, prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == want[0].text
    assert wait_idle(server.engine)["num_free_blocks"] == server.engine.pool.num_blocks


def test_chat_greedy_equal_llm_generate_on_the_template(server, default_llm):
    messages = [{"role": "system", "content": "Speak in verse."}, {"role": "user", "content": "Who goes there?"}]
    prompt = default_llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("ASSISTANT:\n")
    want = default_llm.generate(prompt, _params(max_new_tokens=20))[0]
    r = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(want.prompt_token_ids)
    r = server.client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=20,
                                              temperature=0)
    assert r.choices[0].message.content == want.text


def test_streamed_text_equals_the_answer(server, default_llm):
    want = default_llm.generate(PROMPTS, _params(max_new_tokens=30))
    for prompt, w in zip(PROMPTS, want):
        chunks = list(server.client.completions.create(model=server.model, prompt=prompt, max_tokens=30,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == w.finish_reason
        assert all(c.choices[0].finish_reason is None for c in [c for c in chunks if c.choices][:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(w.token_ids)
        assert all(c.usage is None for c in chunks[:-1])
    messages = [{"role": "user", "content": "Speak."}]
    prompt = default_llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    w = default_llm.generate(prompt, _params(max_new_tokens=30))[0]
    chunks = list(server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=30,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == w.text
    assert chunks[-1].choices[0].finish_reason == w.finish_reason


def test_sse_framing_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]" and payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_seed_and_top_k_as_llm_generate(server, default_llm):
    greedy = default_llm.generate("ROMEO:", _params(max_new_tokens=24))[0].text
    stop = greedy[10:14]
    assert stop.strip(), greedy
    w = default_llm.generate("ROMEO:", _params(max_new_tokens=24, stop=stop))[0]
    r = server.client.completions.create(model=server.model, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == w.text and stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    # streamed: the stop string is cut from the end, so the last delta may carry no text, only the reason
    chunks = list(server.client.completions.create(model=server.model, prompt="ROMEO:", max_tokens=24,
                                                   temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == w.text and chunks[-1].choices[0].finish_reason == "stop"
    for text_stop in [greedy[k:k + 3] for k in range(0, 12, 3)]:
        want = default_llm.generate("ROMEO:", _params(max_new_tokens=24, stop=text_stop))[0]
        chunks = list(server.client.completions.create(model=server.model, prompt="ROMEO:", max_tokens=24,
                                                       temperature=0, stop=text_stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
    sampled = _params(max_new_tokens=24, temperature=0.9, top_k=20, seed=7)
    w = default_llm.generate("ROMEO:", sampled)[0]
    for _ in range(2):         # the seed makes it reproducible, and equal to LLM.generate's
        r = server.client.completions.create(model=server.model, prompt="ROMEO:", max_tokens=24, temperature=0.9,
                                             seed=7, extra_body={"top_k": 20})
        assert r.choices[0].text == w.text
    assert w.text != greedy


# ---------------------------------------------------------------------------------------------- many clients


def test_fifty_concurrent_streams_all_answered_and_blocks_freed(server, default_llm):
    prompts = [f"{NAMES[i % len(NAMES)]}:\n" + "O " * (i % 7) for i in range(50)]
    want = default_llm.generate(prompts, _params(max_new_tokens=16))

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            async def one(prompt):
                stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=16,
                                                         temperature=0, stream=True)
                parts, reason = [], None
                async for chunk in stream:
                    parts.append(chunk.choices[0].text)
                    reason = chunk.choices[0].finish_reason
                return "".join(parts), reason
            return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(main())
    assert [g[0] for g in got] == [w.text for w in want]
    assert [g[1] for g in got] == [w.finish_reason for w in want]
    s = wait_idle(server.engine)
    assert s["num_free_blocks"] == s["num_total_blocks"]


# ---------------------------------------------------------------------------------------------- disconnects


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    url, engine = server.url, server.engine
    aborted = metric(url, "minirt:request_success_total", "finished_reason=abort")
    generated = metric(url, "minirt:generation_tokens_total")
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metric(url, "minirt:num_requests_running") == 1
        assert metric(url, "minirt:kv_blocks_used") > 0
    s = wait_idle(engine, 5)                       # 1500 tokens would take far longer than this on the CPU
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert metric(url, "minirt:request_success_total", "finished_reason=abort") == aborted + 1
    assert metric(url, "minirt:generation_tokens_total") - generated < 1500


def test_disconnect_while_waiting_for_a_plain_answer_aborts(server):
    url, engine = server.url, server.engine
    aborted = metric(url, "minirt:request_success_total", "finished_reason=abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", timeout=0.5,
                   json={"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0})
    s = wait_idle(engine, 5)
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert metric(url, "minirt:request_success_total", "finished_reason=abort") == aborted + 1


# ---------------------------------------------------------------------------------------------- bad input

BAD = [  # (endpoint, body, status, param, words in the message)
    ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),
    ("completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "must be >= 0"),
    ("completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "must be > 0"),
    ("completions", {"prompt": "a", "top_k": -1}, 400, "top_k", "must be >= 0"),
    ("completions", {"prompt": "a", "seed": -1}, 400, "seed", "must be >= 0"),
    ("completions", {"prompt": "a", "n": 2}, 400, "n", "only n = 1"),
    ("completions", {"prompt": "a", "logprobs": 1}, 400, "logprobs", "not supported"),
    ("completions", {"prompt": "a", "stop": 3}, 400, "stop", ""),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop", "non-empty"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"prompt": [5000]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "a " * 3000}, 400, "prompt", "max_model_len = 2048"),
    ("completions", {"prompt": "a", "max_tokens": 5000}, 400, "prompt", "max_model_len = 2048"),
    ("completions", {}, 400, "prompt", "is required"),
    ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("chat/completions", {"messages": []}, 400, "messages", ""),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", ""),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "must be >= 1"),
]


@pytest.mark.parametrize("endpoint,body,status,param,words", BAD, ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_answers_openai_error_json(server, endpoint, body, status, param, words):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param.split(".")[0]) and words in err["message"]
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_the_client_errors(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=server.model, prompt="a", max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="gpt-4", prompt="a")
    assert e.value.code == "model_not_found"
    # nothing was disturbed: the next request is answered, no block is held
    assert server.client.completions.create(model=server.model, prompt="a", max_tokens=2).choices[0].text is not None
    s = wait_idle(server.engine)
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_models_health_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.client.completions.create(model=server.model, prompt="ROMEO:", max_tokens=4, temperature=0)
    for name in ("minirt:time_to_first_token_seconds_count", "minirt:request_time_per_output_token_seconds_count",
                 "minirt:inter_token_latency_seconds_count", "minirt:e2e_request_latency_seconds_count",
                 "minirt:prompt_tokens_total", "minirt:generation_tokens_total", "minirt:kv_blocks_total",
                 "minirt:prefix_cache_queries_total"):
        assert metric(server.url, name) > 0, name
    assert metric(server.url, "minirt:kv_blocks_total") == server.engine.pool.num_blocks
    wait_idle(server.engine)
    for name in ("minirt:num_requests_waiting", "minirt:num_requests_prefilling", "minirt:num_requests_running",
                 "minirt:kv_blocks_used", "minirt:kv_cache_usage_perc", "minirt:num_preemptions_total"):
        assert metric(server.url, name) == 0, name


def _http_get(sock, path: str) -> bytes:
    """One HTTP/1.1 GET on an open socket (keep-alive); the response's bytes, b"" if the server closed it."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: minirt\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def test_idle_keep_alive_outlives_the_openai_clients_own(server):
    """An idle connection stays open past the time after which the openai client's pool drops its idle connections
    (`openai.DEFAULT_CONNECTION_LIMITS`, 5 s), so the client always drops it first. (With both at 5 s, a request sent
    on a pooled connection just as the server closed it failed with "connection reset": a flaky test, once.) One raw
    socket, two requests a second longer than that apart: the second is answered on the same connection."""
    import socket

    idle = openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        assert _http_get(sock, "/health").startswith(b"HTTP/1.1 200")
        time.sleep(idle)
        assert _http_get(sock, "/health").startswith(b"HTTP/1.1 200")


# ---------------------------------------------------------------------------------------------- overload


@pytest.mark.parametrize("mode", MODES)
def test_full_waiting_queue_answers_429_with_retry_after(default_model, mode):
    long = {"prompt": "ROMEO:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    with running_server(mode, default_model, max_num_seqs=1, max_waiting=1) as (url, engine), \
            httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as a:      # admitted, decoding
            lines = a.iter_lines()            # kept: dropping the iterator closes the connection
            next(line for line in lines if line.startswith("data: "))
            def wait_then_give_up():       # answered once A ends, or gives up after 2 s without a byte
                try:
                    httpx.post(url + "/v1/completions", json=long, timeout=2)
                except httpx.ReadTimeout:
                    pass

            waiting = threading.Thread(target=wait_then_give_up)
            waiting.start()                                                 # waits: no seat
            deadline = time.monotonic() + 5
            while engine.stats()["num_waiting"] < 1:
                assert time.monotonic() < deadline, "the second request never reached the waiting queue"
                time.sleep(0.01)
            r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error" and "max_waiting = 1" in r.json()["error"]["message"]
            assert metric(url, "minirt:requests_rejected_total", "reason=queue_full") == 1
        waiting.join()
        s = wait_idle(engine, 5)
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------------------------------- the process


def _serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "minirt", "serve", "--port", str(port), "--device", "cpu", "--log-level",
            "warning", *extra]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _wait_health(proc, url: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never answered /health")


@pytest.mark.parametrize("sig,drain,max_tokens,reason,mode", [
    (signal.SIGTERM, "30", 48, "length", "split"), (signal.SIGINT, "0.5", 1500, "abort", "split"),
    (signal.SIGTERM, "30", 48, "length", "in-process"), (signal.SIGINT, "0.5", 1500, "abort", "in-process")],
    ids=["SIGTERM-drains", "SIGINT-aborts-after-the-deadline", "in-process-SIGTERM-drains",
         "in-process-SIGINT-aborts-after-the-deadline"])
def test_signal_shuts_down_cleanly_with_in_flight_requests_answered(sig, drain, max_tokens, reason, mode):
    from minirt.parallel.workers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--in-process"] if mode == "in-process" else []
    proc = subprocess.Popen(_serve_cmd(port, "--shutdown-timeout", drain, *extra), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_health(proc, url)
        body = {"prompt": "ROMEO:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        results, started = {}, threading.Barrier(3)

        def streamed(i):
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait()
                results[i] = [json.loads(first[6:])] + sse_payloads(SimpleNamespace(iter_lines=lambda: lines))

        def plain():
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=streamed, args=(i,)) for i in range(2)] + [threading.Thread(target=plain)]
        for t in threads:
            t.start()
        started.wait()                     # both streams are decoding
        time.sleep(0.3)                    # and the plain request is in the engine by now
        proc.send_signal(sig)
        for t in threads:
            t.join(60)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    for i in range(2):
        payloads = results[i]
        assert payloads[-1] == "[DONE]"
        text = "".join(p["choices"][0]["text"] for p in payloads[:-1])
        assert payloads[-2]["choices"][0]["finish_reason"] == reason
        assert text
    plain = results["plain"]
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == reason
    tokens = plain.json()["usage"]["completion_tokens"]
    assert tokens == max_tokens if reason == "length" else 0 < tokens < max_tokens


def test_model_that_cannot_load_exits_nonzero_with_the_reason(tmp_path, tiny_models):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(_serve_cmd(8, "--model", str(missing)), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "cannot load the model" in proc.stderr and str(missing) in proc.stderr
    proc = subprocess.run(_serve_cmd(8, "--max-num-seqs", "0"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "max_num_seqs: must be an integer >= 1" in proc.stderr
    for extra in ([], ["--in-process"]):
        proc = subprocess.run(_serve_cmd(8, "--model", tiny_models["qwen3"], *extra), cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=120)   # loads, but answers text without a tokenizer
        assert proc.returncode == 1 and "has no tokenizer" in proc.stderr, proc.stderr[-2000:]
