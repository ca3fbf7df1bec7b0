"""Preemption by recompute: when KV blocks run out, the newest request gives its blocks back and is
recomputed later; its output equals an unpreempted run token for token (greedy against transformers,
seeded sampling against a run on a pool too big to preempt)."""

from __future__ import annotations

import pytest

import minirt
from conftest import hf_greedy, random_prompts

N = 24


@pytest.mark.parametrize("block_size,num_blocks,prefix_caching", [(4, 24, True), (4, 24, False), (1, 80, True),
                                                                   (16, 6, True)])
def test_preempted_greedy_equals_transformers(tiny_model_path, block_size, num_blocks, prefix_caching):
    prompts = random_prompts(5, [3, 17, 40, 9, 33, 1, 26, 12, 38, 20])
    llm = minirt.LLM(tiny_model_path, block_size=block_size, num_kv_blocks=num_blocks, max_prefill_chunk=7,
                     max_num_batched_tokens=16, enable_prefix_caching=prefix_caching, dtype="float32")
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=N, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for all requests at once"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny_model_path, prompt, N)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preempted_seeded_sampling_equals_unpreempted(tiny_models):
    prompts = random_prompts(6, [5, 30, 18, 41, 2, 27, 11, 36])
    params = [minirt.SamplingParams(max_new_tokens=N, ignore_eos=True, temperature=1.0, top_k=50, seed=100 + i)
              for i in range(len(prompts))]
    small = minirt.LLM(tiny_models["llama"], block_size=4, num_kv_blocks=20, dtype="float32")
    big = minirt.LLM(tiny_models["llama"], block_size=4, num_kv_blocks=1000, dtype="float32")
    a, b = small.generate(prompts, params), big.generate(prompts, params)
    assert small.engine.stats()["num_preemptions"] > 0
    assert big.engine.stats()["num_preemptions"] == 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_admission_reserves_only_the_prompt(tiny_models):
    """A pool with room for each prompt but not for every full output admits all of them at once."""
    prompts = random_prompts(7, [8] * 4)
    llm = minirt.LLM(tiny_models["qwen3"], block_size=4, num_kv_blocks=12, max_num_batched_tokens=64, dtype="float32")
    engine = llm.engine
    seen = []
    original = engine.step_fn

    def step():
        progressed = original()
        seen.append(len(engine.running_requests) + len(engine.prefilling_requests))
        return progressed

    engine.step_fn = step
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=20, ignore_eos=True))
    # Reserving prompt + max_new_tokens (7 blocks each) would admit one request at a time.
    assert max(seen) == 4
    assert all(len(o.token_ids) == 20 for o in outs)


def test_preempted_request_goes_to_the_head_of_the_waiting_queue(tiny_models):
    """Observed inside the engine: right after a step that preempted, the victim is first in line, holds no
    blocks, and keeps its generated tokens."""
    prompts = random_prompts(8, [6, 14, 9, 22, 11, 3, 17, 8])
    llm = minirt.LLM(tiny_models["qwen2"], block_size=4, num_kv_blocks=14, max_num_batched_tokens=32,
                     dtype="float32")
    seen = []

    def check(engine, batch):
        if engine.scheduler.num_preemptions > len(seen):
            head = engine.waiting_queue[0]
            seen.append(head.num_preemptions > 0 and not head.block_table and head.num_output_tokens > 0)

    llm.engine.step_callbacks.append(check)
    llm.generate(prompts, minirt.SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert seen and all(seen)


def test_cached_token_counters_count_the_first_admission_only(tiny_models):
    """A preempted request's recomputed tokens are not prefix-cache hits: `num_cached_tokens` is what the cache
    held when the prompt was first admitted (seen by matching just before that admission), and every prompt is
    queried once."""
    shared = random_prompts(8, [9])[0]
    prompts = [shared + p for p in random_prompts(9, [3, 14, 1, 8, 20, 5])] + random_prompts(10, [5, 17])
    llm = minirt.LLM(tiny_models["qwen3"], block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
                     max_prefill_chunk=7, dtype="float32")
    sched = llm.engine.scheduler
    first_hits, original = {}, sched.try_allocate

    def try_allocate(request):
        hits = len(sched.prefix_cache.match(request.token_ids)) * sched.config.block_size
        admitted = original(request)
        if admitted and request.request_id not in first_hits:
            first_hits[request.request_id] = hits
        return admitted

    sched.try_allocate = try_allocate
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=N, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for all requests at once"
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens <= len(prompt)
        assert out.num_cached_tokens == first_hits[out.request_id]
    assert any(first_hits.values()), "the shared prefix was meant to be hit"
    assert stats["prefix_cache_queries"] == sum(map(len, prompts))
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outs)
    assert stats["num_preempted_recomputed_tokens"] > 0
