"""Greedy output is token-for-token equal to transformers' generate(do_sample=False) through every path.

Oracle: transformers, batch 1, no padding, float32 (see conftest.hf_greedy).
"""

import random

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


def greedy(n: int) -> "minirt.SamplingParams":
    return minirt.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def make_llm(path, device, **kw):
    if device != "cpu":  # the GPU default sizes the pool from free memory; keep test engines small
        kw.setdefault("num_kv_blocks", 4096)
    return minirt.LLM(model=path, device=device, dtype=torch.float32, **kw)


def check_outputs(path, prompts, outs, ns):
    assert len(outs) == len(prompts)
    for i, (p, out, n) in enumerate(zip(prompts, outs, ns)):
        assert list(out.prompt_token_ids) == list(p), f"request {i}: outputs not in prompt order"
        want = hf_greedy(path, p, n)
        assert list(out.token_ids) == want, f"request {i} (prompt len {len(p)}, n={n}) differs from transformers"
        assert out.finish_reason == "length", f"request {i}: {out.finish_reason} {out.error}"
        assert out.error is None


# ---------------------------------------------------------------------------------------------------------
# chapters 01-02: naive loop and contiguous KV cache
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def loaded(tiny_model_path, device):
    model, _ = minirt.load_model(tiny_model_path, device=device, dtype=torch.float32)
    return model


def test_naive_generate(loaded, tiny_model_path):
    from minirt.generate import naive_generate

    for p in random_prompts(101, [1, 7, 23]):
        got = naive_generate(loaded, p, max_new_tokens=10)
        assert got == hf_greedy(tiny_model_path, p, 10)


def test_kv_cache_solo(loaded, tiny_model_path):
    from minirt.generate import kv_cache_generate

    for p in random_prompts(102, [1, 9, 33]):
        (got,) = kv_cache_generate(loaded, [p], max_new_tokens=12)
        assert got == hf_greedy(tiny_model_path, p, 12)


def test_kv_cache_static_batch_mixed_lengths(loaded, tiny_model_path):
    from minirt.generate import kv_cache_generate

    prompts = random_prompts(103, [1, 5, 17, 30, 2, 30])
    got = kv_cache_generate(loaded, prompts, max_new_tokens=12)
    assert len(got) == len(prompts)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(tiny_model_path, p, 12)


def test_naive_and_kv_cache_stop_at_eos(loaded, tiny_model_path):
    """With eos_token_id set to a token the model emits, generation ends right after it (EOS included)."""
    from minirt.generate import kv_cache_generate, naive_generate

    (p,) = random_prompts(104, [6])
    ref = hf_greedy(tiny_model_path, p, 10)
    eos = ref[3]
    cut = ref[: ref.index(eos) + 1]
    assert naive_generate(loaded, p, max_new_tokens=10, eos_token_id=eos) == cut
    (other,) = random_prompts(105, [9])
    ref_other = hf_greedy(tiny_model_path, other, 10)
    got = kv_cache_generate(loaded, [p, other], max_new_tokens=10, eos_token_id=eos)
    assert got[0] == cut
    want_other = ref_other[: ref_other.index(eos) + 1] if eos in ref_other else ref_other
    assert got[1] == want_other


# ---------------------------------------------------------------------------------------------------------
# chapters 03-06: paged blocks, prefix cache, engine, chunked prefill
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_llm_block_sizes_and_boundaries(tiny_model_path, device, block_size):
    b = block_size
    lengths = sorted({n for n in (b - 1, b, b + 1, 2 * b) if n >= 1})
    prompts = random_prompts(200 + b, lengths)
    n = 2 * b + 3  # decode crosses at least two block boundaries
    llm = make_llm(tiny_model_path, device, block_size=b)
    # each prompt alone, then all together
    for p in prompts:
        check_outputs(tiny_model_path, [p], llm.generate([p], greedy(n)), [n])
    check_outputs(tiny_model_path, prompts, llm.generate(prompts, greedy(n)), [n] * len(prompts))
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_llm_without_prefix_caching(tiny_model_path, device):
    prompts = random_prompts(210, [3, 8, 8, 13])
    prompts[2] = list(prompts[1])
    llm = make_llm(tiny_model_path, device, block_size=4, enable_prefix_caching=False)
    check_outputs(tiny_model_path, prompts, llm.generate(prompts, greedy(9)), [9] * 4)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_cache_same_prompt_twice(tiny_model_path, device, block_size):
    llm = make_llm(tiny_model_path, device, block_size=block_size, enable_prefix_caching=True)
    # lengths: exact block multiples (the whole prompt is cached: last token must be recomputed) and not
    for n_prompt in (2 * block_size, 2 * block_size + 3):
        (p,) = random_prompts(300 + n_prompt, [n_prompt])
        # separate generate calls: the second one hits the cache
        check_outputs(tiny_model_path, [p], llm.generate([p], greedy(7)), [7])
        (second,) = llm.generate([p], greedy(7))
        check_outputs(tiny_model_path, [p], [second], [7])
        cached = getattr(second, "num_cached_tokens", None)  # not in the contract: checked when present
        if cached is not None:
            assert block_size <= cached < n_prompt, f"expected a prefix-cache hit, got {cached} cached tokens"
        # same prompt several times in one call
        check_outputs(tiny_model_path, [p] * 3, llm.generate([p] * 3, greedy(7)), [7] * 3)
        # the cached prompt plus its own greedy continuation (a hit that covers a decode-written block)
        cont = p + hf_greedy(tiny_model_path, p, 7)
        check_outputs(tiny_model_path, [cont], llm.generate([cont], greedy(5)), [5])
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_cache_shared_prefix(tiny_model_path, device):
    rng = random.Random(310)
    (prefix,) = random_prompts(311, [21])
    suffix_lens = [0, 1, 2, 3, 4, 5, 11]
    prompts = [prefix + [rng.randrange(512) for _ in range(k)] for k in suffix_lens]
    llm = make_llm(tiny_model_path, device, block_size=4)
    ns = [6 + (i % 3) for i in range(len(prompts))]
    params = [greedy(n) for n in ns]
    # all at once (sharing inside one batch), then again in reversed order (hits from the previous call)
    check_outputs(tiny_model_path, prompts, llm.generate(prompts, params), ns)
    check_outputs(tiny_model_path, prompts[::-1], llm.generate(prompts[::-1], params[::-1]), ns[::-1])
    # one by one
    for p, n in zip(prompts, ns):
        check_outputs(tiny_model_path, [p], llm.generate([p], greedy(n)), [n])
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill(tiny_model_path, device, prefix_caching):
    prompts = random_prompts(400, [1, 2, 3, 4, 9, 17, 31])
    prompts.append(prompts[5][:12] + prompts[6][:5])  # shares a prefix with prompt 5
    llm = make_llm(tiny_model_path, device, block_size=4, max_prefill_chunk=3, max_num_batched_tokens=5,
                   enable_prefix_caching=prefix_caching)
    ns = [1, 3, 8, 5, 8, 2, 8, 6]
    params = [greedy(n) for n in ns]
    check_outputs(tiny_model_path, prompts, llm.generate(prompts, params), ns)
    steps = llm.engine.stats().get("num_steps")
    if steps is not None:  # not in the contract: checked when present
        assert steps >= sum(map(len, prompts)) / 5, "prefill was not split by the token budget"
    check_outputs(tiny_model_path, prompts, llm.generate(prompts, params), ns)  # again, with cache hits
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("config", ["default", "constrained"])
def test_many_concurrent_requests(tiny_model_path, device, config):
    rng = random.Random(500)
    n_req = 36
    prompts = random_prompts(501, [rng.randint(1, 60) for _ in range(n_req)])
    ns = [rng.randint(1, 20) for _ in range(n_req)]
    kw = dict(block_size=4)
    if config == "constrained":  # forces queueing, chunking and interleaving of prefill with decode
        kw.update(max_num_seqs=7, max_num_batched_tokens=40, max_prefill_chunk=16, block_size=8)
    llm = make_llm(tiny_model_path, device, **kw)
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    check_outputs(tiny_model_path, prompts, outs, ns)
    assert len({o.request_id for o in outs}) == n_req
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_waiting"] == stats["num_prefilling"] == stats["num_running"] == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_small_pool_preemption(tiny_model_path, device, prefix_caching):
    """A pool far smaller than the batch's needs: requests queue and get preempted, outputs are unchanged."""
    rng = random.Random(550)
    prompts = random_prompts(551, [rng.randint(8, 30) for _ in range(14)])
    prompts[5] = prompts[2][:16] + prompts[5][:6]  # a shared prefix too
    ns = [rng.randint(10, 24) for _ in prompts]
    llm = make_llm(tiny_model_path, device, block_size=4, num_kv_blocks=16, max_prefill_chunk=8,
                   max_num_batched_tokens=24, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    check_outputs(tiny_model_path, prompts, outs, ns)
    preemptions = getattr(getattr(llm.engine, "scheduler", None), "num_preemptions", None)
    if preemptions is not None:  # not in the contract: checked when present
        assert preemptions > 0, "the workload was meant to force preemption"
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 16


def test_single_sampling_params_applies_to_all(tiny_models, device):
    path = tiny_models["llama"]
    prompts = random_prompts(600, [4, 10])
    llm = make_llm(path, device)
    outs = llm.generate(prompts, greedy(5))
    check_outputs(path, prompts, outs, [5, 5])
