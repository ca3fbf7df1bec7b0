"""OpenAI/vLLM compatibility of `python -m minirt serve`: every request field honoured or refused by name, chat
shapes SDKs send, and every error path in OpenAI's `{"error": {"message", "type", "param", "code"}}` shape.

Oracles: `LLM.generate` / `Engine` on the same prompt and parameters for honoured fields (an honoured field changes
the answer exactly as the engine's parameter does); the README's compatibility table for what is refused
(`protocol.REFUSED`, checked against the fields the models declare); the official `openai` client, which sends
what real SDK users send (`extra_body` for vLLM's extensions).
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

import minirt
from minirt.serve import protocol
from minirt.serve.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(default_model):
    engine = minirt.Engine(default_model, device="cpu", dtype="float32")
    bg = BackgroundServer(engine, max_waiting=1)
    url = bg.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield SimpleNamespace(url=url, engine=engine, client=client, http=httpx.Client(base_url=url, timeout=60))
    bg.stop()


@pytest.fixture(scope="module")
def llm(default_model):
    return minirt.LLM(default_model, device="cpu", dtype="float32")


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and not err["message"].startswith("None"), err
    return err


# ============================================================================ honoured


def test_stop_token_ids_ignore_eos_top_k_seed_user_as_the_engine(server, llm):
    prompt = "KING HENRY:\nOnce more unto the breach"
    free = llm.generate(prompt, minirt.SamplingParams(max_new_tokens=12))[0]
    stop_id = free.token_ids[5]
    r = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=12, temperature=0,
                                         user="u-1", n=1, extra_body={"stop_token_ids": [stop_id]})
    want = llm.generate(prompt, minirt.SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)))[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.token_ids) < 12

    params = dict(max_new_tokens=24, temperature=0.9, top_k=5, seed=7, ignore_eos=True)
    want = llm.generate(prompt, minirt.SamplingParams(**params))[0]
    r = server.client.completions.create(model="default_model", prompt=prompt, max_tokens=24, temperature=0.9,
                                         seed=7, extra_body={"top_k": 5, "ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 24


def test_max_completion_tokens_stream_options_and_chat_shapes(server, llm):
    c = server.client
    r = c.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Speak."}],
                                  max_completion_tokens=5, max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5                       # the newer name wins, as in vLLM
    chunks = list(c.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Speak."}],
                                            max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    # content as text parts is the same conversation as the joined string; content null on an assistant message
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Who"}, {"type": "text", "text": "goes there?"}]},
             {"role": "assistant", "content": None},
             {"role": "function", "name": "f", "content": "{}"},
             {"role": "tool", "tool_call_id": "t1", "content": "done"},
             {"role": "user", "content": "Speak."}]
    joined = [dict(m, content="" if m["content"] is None else "\n".join(p["text"] for p in m["content"])
                   if isinstance(m["content"], list) else m["content"]) for m in parts]
    text = server.engine.tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    want = llm.generate([server.engine.tokenizer.encode(text, add_special_tokens=False)],
                        minirt.SamplingParams(max_new_tokens=6))[0]
    r = c.chat.completions.create(model="default_model", messages=parts, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == want.text
    err = openai_error(server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]}),
                       400)
    assert err["param"] == "messages.0.content"
    err = openai_error(server.http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    assert err["param"] == "messages.0.content.0.type"
    err = openai_error(server.http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
                       400)
    assert err["param"] == "messages.0.role"


# ============================================================================ refused by name


ASKS = {"n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
        "logit_bias": {"5": 10}, "min_p": 0.1, "min_tokens": 3, "response_format": {"type": "json_object"},
        "skip_special_tokens": False, "include_stop_str_in_output": True, "logprobs": True, "top_logprobs": 2,
        "echo": True, "suffix": "x", "best_of": 2, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
        "store": True, "metadata": {"a": "b"}, "service_tier": "flex", "modalities": ["audio"],
        "audio": {"voice": "x"}, "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
        "web_search_options": {}, "verbosity": "low"}


def body_of(endpoint: str, **fields) -> dict:
    base = {"prompt": "ROMEO:"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    return {**base, "max_tokens": 2, **fields}


def test_the_table_covers_every_declared_field():
    """Every field a request model declares is in the README's table, honoured or refused (no third kind)."""
    readme = (ROOT / "README.md").read_text()
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        for name in model.model_fields:
            assert f"`{name}`" in readme, f"{name} is missing from the README's compatibility table"
    assert set(ASKS) == set(protocol.REFUSED)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("field", sorted(ASKS))
def test_each_refused_field_is_refused_by_name_and_its_no_op_passes(server, endpoint, field):
    model = protocol.CompletionRequest if endpoint == "completions" else protocol.ChatCompletionRequest
    value = ASKS[field]
    if field == "logprobs" and endpoint == "completions":
        value = 1
    r = server.http.post(f"/v1/{endpoint}", json=body_of(endpoint, **{field: value}))
    err = openai_error(r, 400)
    assert err["param"] == field and err["message"].startswith(field + ":"), err
    if field in model.model_fields:
        for noop in (None, *protocol.REFUSED[field][0]):
            assert server.http.post(f"/v1/{endpoint}", json=body_of(endpoint, **{field: noop})).status_code == 200


def test_the_official_client_gets_a_named_400_for_what_it_can_send(server):
    c = server.client
    msgs = [{"role": "user", "content": "Hi"}]
    for kw in [dict(presence_penalty=1.0), dict(frequency_penalty=1.0), dict(logit_bias={"5": 1}), dict(n=2),
               dict(logprobs=True), dict(response_format={"type": "json_object"}), dict(parallel_tool_calls=True),
               dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="auto")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="default_model", messages=msgs, max_tokens=2, **kw)
        assert e.value.body["param"] == next(iter(kw)), (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default_model", prompt="Hi", max_tokens=2, extra_body={"guided_json": {}})
    assert e.value.body["param"] == "guided_json" and "unknown fields are refused" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default_model", prompt="Hi", max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


# ============================================================================ every error path


def test_every_error_path_is_in_openai_shape(server, monkeypatch):
    h = server.http
    assert openai_error(h.get("/v1/nope"), 404)["type"] == "not_found_error"
    assert "no such route" in openai_error(h.post("/nope", json={}), 404)["message"]
    err = openai_error(h.get("/v1/completions"), 405)
    assert "POST" in err["message"]
    assert openai_error(h.post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"}),
                        400)["param"] == "body"
    assert openai_error(h.post("/v1/completions", json=[1, 2]), 400)["param"] == "body"
    assert openai_error(h.post("/v1/completions", content=b""), 400)["param"] == "body"
    assert openai_error(h.post("/v1/completions", json={"max_tokens": 2}), 400)["param"] == "prompt"
    assert openai_error(h.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert openai_error(h.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"}), 404)["param"] == "model"
    assert openai_error(h.post("/v1/completions", content=b"x" * (9 * 2**20)), 413)["param"] is None
    r = h.post("/v1/completions", content=b"GET", headers={"content-type": "application/json"})
    assert openai_error(r, 400)["message"].startswith("body: malformed JSON")

    host, port = server.url.split("//")[1].split(":")
    for raw in [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000]:  # a head over 64 KiB
        with socket.create_connection((host, int(port)), timeout=10) as sock:      # h11 cannot take it
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400")
        assert json.loads(body)["error"]["message"].startswith("request: invalid HTTP")

    def broken(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(server.engine, "submit", broken)
    err = openai_error(h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
    assert err["type"] == "server_error"
    monkeypatch.undo()

    # 429 and 503 as admission answers them (the queue bound and the drain are tested in test_serve.py)
    from minirt.serve import app as app_module
    for status, kind in [(429, "rate_limit_error"), (503, "server_error")]:
        monkeypatch.setattr(app_module, "admission", lambda *a, status=status: (status, "refused for the test"))
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert openai_error(r, status)["type"] == kind and r.headers["retry-after"] == "1"
    monkeypatch.undo()


def test_the_echo_of_a_bad_field_is_capped(server):
    for body in [{"prompt": "x", "temperature": "t" * 2**21}, {"prompt": "x", "stop_token_ids": list(range(10**5))},
                 {"prompt": "x", "n": "9" * 5000}, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(10**5)}},
                 {"prompt": "x", "x" * 2**20: 1}]:
        r = server.http.post("/v1/completions", json=body)
        assert r.status_code == 400 and len(r.content) < 2000, (r.status_code, len(r.content))
    err = protocol.error_body("m" * 10**6, param="p" * 10**6)["error"]             # the last guard, whatever quotes
    assert len(err["message"]) < protocol.MAX_MESSAGE_CHARS + 50 and len(err["param"]) < protocol.MAX_ECHO_CHARS + 5


# ============================================================================ text the tokenizer cannot take


def test_a_surrogate_is_a_400_here_and_a_value_error_in_the_engine(server, llm):
    for path, raw in [("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
                      ("/v1/completions", b'{"prompt": ["\\udfffz"], "max_tokens": 2}'),
                      ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
                      ("/v1/chat/completions",
                       b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}')]:
        err = openai_error(server.http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert "surrogate" in err["message"] and err["param"] in ("prompt", "messages"), err
    with pytest.raises(ValueError, match="prompt: is not valid Unicode text: unpaired surrogate"):
        llm.generate("a\ud800b")
    with pytest.raises(ValueError, match="prompt: is not valid Unicode"):
        llm.generate(["fine", "\udc00"])

    async def engine_side():
        async with minirt.Engine(llm.engine.model.checkpoint_path, device="cpu", dtype="float32") as engine:
            with pytest.raises(ValueError, match="prompt: is not valid Unicode"):
                await engine.generate("x\ud800")
    asyncio.run(engine_side())


def test_text_longer_than_the_character_bound_is_refused_before_the_tokenizer(llm, monkeypatch):
    engine = llm.engine
    bound = engine.max_prompt_chars
    assert bound == engine.config.max_model_len * max(map(len, engine.tokenizer.get_vocab()))
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(ValueError, match=f"prompt: {bound + 1} characters cannot fit in max_model_len"):
        llm.generate("x" * (bound + 1))
    assert calls == []
