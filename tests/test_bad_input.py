"""Table-driven bad input: every field of SamplingParams and every kind of bad prompt is refused with a
ValueError that names the field and the limit, while a request already in flight is undisturbed."""

from __future__ import annotations

import asyncio
import math

import pytest

import minirt
from conftest import VOCAB, hf_greedy, random_prompts

# field, bad value, words the message must contain (the field and its limit)
SAMPLING_CASES = [
    ("max_new_tokens", 0, [">= 1"]), ("max_new_tokens", -5, [">= 1"]), ("max_new_tokens", 2.5, ["integer"]),
    ("max_new_tokens", "8", ["integer"]), ("max_new_tokens", True, ["integer"]),
    ("temperature", -0.5, [">= 0"]), ("temperature", math.nan, ["finite"]), ("temperature", math.inf, ["finite"]),
    ("temperature", "hot", [">= 0"]),
    ("top_p", 0.0, ["(0, 1]"]), ("top_p", 1.5, ["(0, 1]"]), ("top_p", -1, ["(0, 1]"]), ("top_p", None, ["(0, 1]"]),
    ("top_k", -1, [">= 0"]), ("top_k", 3.0, ["integer"]),
    ("seed", 1.5, ["integer"]), ("seed", "42", ["integer"]),
    ("stop", [""], ["non-empty"]), ("stop", [1], ["string"]), ("stop", 5, ["string"]),
    ("stop_token_ids", [-1], [">= 0"]), ("stop_token_ids", ["a"], ["integers"]), ("stop_token_ids", 3, ["sequence"]),
    ("ignore_eos", "yes", ["bool"]),
]


@pytest.mark.parametrize("field,value,words", SAMPLING_CASES, ids=[f"{f}={v!r}" for f, v, _ in SAMPLING_CASES])
def test_sampling_params_fields(field, value, words):
    with pytest.raises(ValueError) as info:
        minirt.SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    for w in words:
        assert w in message, message


BLOCK, NUM_BLOCKS, MAX_LEN = 4, 16, 48   # the pool holds 64 tokens, a request at most 48

PROMPT_CASES = [
    ("empty list", [], "prompt", "at least one token"),
    ("int", 5, "prompt", "list of int"),
    ("None", None, "prompt", "list of int"),
    ("dict", {"a": 1}, "prompt", "list of int"),
    ("floats", [1.0, 2.0], "prompt", "list of int"),
    ("bools", [True, False], "prompt", "list of int"),
    ("text without tokenizer", "hello", "prompt", "no tokenizer"),
    ("id -1", [3, -1, 4], "prompt", f"[0, {VOCAB})"),
    ("id = vocab", [3, VOCAB, 4], "prompt", f"[0, {VOCAB})"),
    ("too long", list(range(45)), "max_model_len", f"max_model_len = {MAX_LEN}"),
]


@pytest.fixture(scope="module")
def engine_kw():
    return dict(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, dtype="float32")


@pytest.mark.parametrize("name,prompt,field,limit", PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_refused_while_another_request_runs(tiny_models, engine_kw, name, prompt, field, limit):
    path = tiny_models["llama"]
    (good,) = random_prompts(31, [9])

    async def main():
        async with minirt.Engine(path, **engine_kw) as engine:
            running = asyncio.ensure_future(
                engine.generate(good, minirt.SamplingParams(max_new_tokens=12, ignore_eos=True)))
            await asyncio.sleep(0)          # the good request is submitted and in the engine
            before = engine.stats()
            with pytest.raises(ValueError) as info:
                await engine.generate(prompt, minirt.SamplingParams(max_new_tokens=4))
            assert field in str(info.value) and limit in str(info.value), str(info.value)
            after = engine.stats()
            assert {k: after[k] for k in ("num_waiting", "num_prefilling", "num_running")} == \
                   {k: before[k] for k in ("num_waiting", "num_prefilling", "num_running")}
            out = await running
            assert out.token_ids == hf_greedy(path, good, 12)
            assert engine.stats()["num_free_blocks"] == NUM_BLOCKS

    asyncio.run(main())


def test_request_larger_than_the_pool(tiny_models):
    """max_model_len allows it, but the pool (16 blocks of 4 = 64 tokens) cannot ever hold it."""
    llm = minirt.LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, dtype="float32")
    with pytest.raises(ValueError, match=r"num_kv_blocks = 16") as info:
        llm.generate([list(range(60))], minirt.SamplingParams(max_new_tokens=10))
    assert "prompt + max_new_tokens" in str(info.value)
    out = llm.generate([list(range(50))], minirt.SamplingParams(max_new_tokens=14, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny_models["llama"], list(range(50)), 14)   # exactly the whole pool


def test_bad_request_ids_and_timeouts(tiny_models, engine_kw):
    async def main():
        async with minirt.Engine(tiny_models["llama"], **engine_kw) as engine:
            first = asyncio.ensure_future(engine.generate([1, 2, 3], minirt.SamplingParams(max_new_tokens=8),
                                                          request_id="same"))
            await asyncio.sleep(0)
            with pytest.raises(ValueError, match="request_id: 'same' is already in flight"):
                await engine.generate([4, 5], minirt.SamplingParams(max_new_tokens=2), request_id="same")
            for bad in ("", 7):
                with pytest.raises(ValueError, match="request_id"):
                    await engine.generate([4, 5], minirt.SamplingParams(max_new_tokens=2), request_id=bad)
            for bad in (0, -1):
                with pytest.raises(ValueError, match=r"timeout: must be > 0"):
                    await engine.generate([4, 5], minirt.SamplingParams(max_new_tokens=2), timeout=bad)
            with pytest.raises(ValueError, match="sampling_params"):
                await engine.generate([4, 5], {"max_new_tokens": 2})
            assert (await first).finish_reason == "length"
            # the id is free again once the first request is done
            assert (await engine.generate([4, 5], minirt.SamplingParams(max_new_tokens=2),
                                          request_id="same")).finish_reason == "length"

    asyncio.run(main())


@pytest.mark.parametrize("field,value", [("block_size", 0), ("num_kv_blocks", 0), ("max_num_seqs", -1),
                                         ("max_num_batched_tokens", 0), ("max_prefill_chunk", 1.5),
                                         ("max_model_len", 0), ("enable_prefix_caching", "yes"),
                                         ("max_model_len", 10**6), ("dtype", "int8"),
                                         ("attention_backend", "cuda"), ("attention_backend", None),
                                         ("split_kv", 1), ("enforce_eager", "yes"), ("fused_ops", "on"),
                                         ("merge_projections", 0), ("gemv", "yes"), ("norm_in_gemv", 1),
                                         ("rotary_kernel", "on"), ("pdl", "on"), ("kv_write_in_rotary", 1),
                                         ("combine_in_attention", "yes"), ("prefetch_kv", "on"),
                                         ("l2_prefetch", 1)])
def test_bad_engine_settings(tiny_models, field, value):
    with pytest.raises(ValueError, match=field):
        minirt.Engine(tiny_models["llama"], **{field: value})


@pytest.mark.parametrize("device,words", [("cuda:99", "device: 'cuda:99'"), ("foo", "device: expected 'cpu'"),
                                          ("meta", "device: expected 'cpu'")])
def test_bad_device_named(tiny_models, device, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        minirt.LLM(tiny_models["llama"], device=device)


def test_llm_sampling_params_of_the_wrong_type(tiny_models):
    llm = minirt.LLM(tiny_models["llama"], dtype="float32")
    with pytest.raises(ValueError, match="sampling_params: must be a minirt.SamplingParams or a list of them, got dict"):
        llm.generate([[1, 2]], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match=r"stop_token_ids: 100000 is outside the vocabulary \[0, 512\)"):
        llm.generate([[1, 2]], minirt.SamplingParams(stop_token_ids=[100000]))
    with pytest.raises(ValueError, match=r"seed: must be an integer in \[0, 2\*\*63\)"):
        minirt.SamplingParams(seed=2**70)


def test_bench_refuses_before_it_builds_anything(monkeypatch, capsys):
    """`python -m minirt bench` resolves the engine's plan (and so its refusals) before the bandwidth copy or the
    checkpoint."""
    from minirt import bench

    def refuse(config, device, model_config):
        raise ValueError(f"prefetch_kv: refused for {device.type}, prefetch_kv={config.prefetch_kv}")

    monkeypatch.setattr(bench, "resolve_plan", refuse)
    monkeypatch.setattr(bench, "bench", lambda *a, **k: pytest.fail("ran the benchmark before refusing"))
    parser = __import__("argparse").ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--device", "cpu", "--prefetch-kv", "on", "--enforce-eager"])
    assert bench.run(args) == 2
    assert "error: prefetch_kv: refused for cpu, prefetch_kv=True" in capsys.readouterr().err
