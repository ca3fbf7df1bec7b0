"""Invalid input is refused at submission with a ValueError naming the field; nothing else is disturbed."""

import asyncio

import pytest
import torch

import minirt
from conftest import VOCAB, hf_greedy, random_prompts


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        minirt.SamplingParams(**kwargs)


def test_sampling_params_valid_edges():
    minirt.SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    minirt.SamplingParams(top_p=1e-6, top_k=1, temperature=100.0, seed=0, stop=("x",), stop_token_ids=(1, 2))


# ---------------------------------------------------------------------------------------------------------
# submission-time validation, LLM and Engine
# ---------------------------------------------------------------------------------------------------------
BLOCK = 4
NUM_KV_BLOCKS = 8    # "small_pool": the pool holds 32 tokens; max_model_len from the config (512)
MAX_MODEL_LEN = 64   # "short_len": max_model_len 64, default (large) pool

CONFIGS = {
    "small_pool": dict(device="cpu", dtype=torch.float32, block_size=BLOCK, num_kv_blocks=NUM_KV_BLOCKS),
    "short_len": dict(device="cpu", dtype=torch.float32, block_size=BLOCK, max_model_len=MAX_MODEL_LEN),
}


def _bad_cases():
    """(config, prompt, params, regex the message must match)."""
    good = random_prompts(900, [5])[0]
    sp = minirt.SamplingParams(max_new_tokens=4)
    return [
        ("small_pool", [], sp, "prompt"),
        ("short_len", [], sp, "prompt"),
        ("short_len", random_prompts(901, [60])[0], minirt.SamplingParams(max_new_tokens=10), "max_model_len"),
        ("short_len", random_prompts(901, [65])[0], minirt.SamplingParams(max_new_tokens=1), "max_model_len"),
        ("small_pool", random_prompts(902, [30])[0], minirt.SamplingParams(max_new_tokens=10), "num_kv_blocks"),
        ("small_pool", random_prompts(902, [40])[0], minirt.SamplingParams(max_new_tokens=1), "num_kv_blocks"),
        ("small_pool", good[:2] + [VOCAB] + good[3:], sp, "prompt|vocab"),
        ("short_len", good[:2] + [-1] + good[3:], sp, "prompt|vocab"),
    ]


@pytest.fixture(scope="module")
def llms(tiny_models):
    return {name: minirt.LLM(model=tiny_models["qwen2"], **kw) for name, kw in CONFIGS.items()}


@pytest.fixture
def llm(llms):
    return llms["small_pool"]


def _assert_serves(llm, path, seed):
    (p,) = random_prompts(seed, [6])
    out = llm.generate([p], minirt.SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(path, p, 5) and out.finish_reason == "length"
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_llm_rejects_bad_request(llms, tiny_models, case):
    config, prompt, params, field = _bad_cases()[case]
    llm = llms[config]
    with pytest.raises(ValueError, match=f"(?i){field}"):
        llm.generate([prompt], params)
    _assert_serves(llm, tiny_models["qwen2"], 910 + case)


def test_small_pool_size(llm):
    assert llm.engine.stats()["num_total_blocks"] == NUM_KV_BLOCKS


def test_llm_text_prompt_without_tokenizer_raises(llm, tiny_models):
    with pytest.raises(ValueError):
        llm.generate("hello", minirt.SamplingParams(max_new_tokens=3))
    _assert_serves(llm, tiny_models["qwen2"], 920)


def test_empty_text_prompt(default_llm):
    with pytest.raises(ValueError, match="prompt"):
        default_llm.generate("", minirt.SamplingParams(max_new_tokens=3))
    out = default_llm.generate("ROMEO:", minirt.SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_llm_bad_request_in_batch_refuses_before_running(llm, tiny_models):
    """A batch with one invalid prompt is refused at submission; the engine then still serves."""
    good = random_prompts(930, [5, 7])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([good[0], [], good[1]], minirt.SamplingParams(max_new_tokens=4, ignore_eos=True))
    _assert_serves(llm, tiny_models["qwen2"], 931)


def test_llm_sampling_params_list_length_mismatch(llm):
    prompts = random_prompts(940, [3, 4])
    with pytest.raises(ValueError):
        llm.generate(prompts, [minirt.SamplingParams(max_new_tokens=2)] * 3)


def test_requests_at_the_limits_are_accepted(llms, tiny_models):
    path = tiny_models["qwen2"]
    # whole pool: 32 tokens = prompt 28 + 4 new
    (p,) = random_prompts(950, [28])
    out = llms["small_pool"].generate([p], minirt.SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(path, p, 4)
    # prompt + max_new_tokens == max_model_len
    (p,) = random_prompts(951, [MAX_MODEL_LEN - 4])
    out = llms["short_len"].generate([p], minirt.SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(path, p, 4)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_rejects_bad_requests_and_keeps_serving(tiny_models, config):
    path = tiny_models["qwen2"]

    async def main():
        async with minirt.Engine(model=path, **CONFIGS[config]) as engine:
            (good,) = random_prompts(960, [6])
            background = asyncio.ensure_future(
                engine.generate(good, minirt.SamplingParams(max_new_tokens=12, ignore_eos=True)))
            await asyncio.sleep(0)
            for cfg, prompt, params, field in _bad_cases():
                if cfg != config:
                    continue
                with pytest.raises(ValueError, match=f"(?i){field}"):
                    await engine.generate(prompt, params)
            # duplicate request id while the first is in flight
            first = asyncio.ensure_future(
                engine.generate(good, minirt.SamplingParams(max_new_tokens=10, ignore_eos=True), request_id="dup"))
            for _ in range(3):
                await asyncio.sleep(0)
            with pytest.raises(ValueError, match="request_id"):
                await engine.generate(good, minirt.SamplingParams(max_new_tokens=2), request_id="dup")
            out_bg, out_first = await asyncio.wait_for(asyncio.gather(background, first), 60)
            assert list(out_bg.token_ids) == hf_greedy(path, good, 12)
            assert list(out_first.token_ids) == hf_greedy(path, good, 10)
            assert out_first.request_id == "dup" and out_first.finish_reason == "length"
            out = await asyncio.wait_for(
                engine.generate(good, minirt.SamplingParams(max_new_tokens=3, ignore_eos=True)), 60)
            assert list(out.token_ids) == hf_greedy(path, good, 3)
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]

    asyncio.run(main())
