"""Tensor parallelism (chapter 09, `minirt.parallel`): greedy output with `tensor_parallel_size=2` on the CPU (gloo,
float32, two processes) equal to one process and to `transformers`, through the prefix cache, chunked prefill,
preemption, stop strings and streaming; each sharded layer against the unsharded one; the refusals; the
runner in a world of one (gloo here, NCCL on a GPU); two GPUs over NCCL where present.

One TP engine serves the whole module (starting two processes costs seconds on two cores); the faults, which
end their engine, are in `test_tensor_parallel_faults.py`.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch
from torch import nn

import minirt
from conftest import hf_greedy, random_prompts
from minirt.parallel import (Communicator, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                             build_tensor_parallel_runner, check_shardable, column_parallel)
from minirt.parallel.workers import pack_step, unpack_step

# Small pool, chunk and budget: long prompts prefill in chunks, the pool runs out (preemption), blocks are shared.
KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=24,
          max_prefill_chunk=8, enable_prefix_caching=True)
GREEDY = minirt.SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(default_model):
    """(one-process LLM, TP=2 LLM) over the embedded checkpoint with the same settings."""
    single = minirt.LLM(default_model, **KW)
    tp = minirt.LLM(default_model, tensor_parallel_size=2, **KW)
    yield single, tp
    tp.engine.model_runner.close()


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def test_greedy_equals_one_process_and_transformers_with_chunked_prefill(engines, default_model):
    single, tp = engines
    prompts = random_prompts(3, [5, 30, 17, 41, 2], vocab=4096)
    outs = tp.generate(prompts, GREEDY)
    assert token_ids(outs) == token_ids(single.generate(prompts, GREEDY))
    assert token_ids(outs) == [hf_greedy(default_model, p, 16) for p in prompts]
    stats = tp.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def assert_same_and_counted(single, tp, prompts, params, counter):
    """TP output equal to one process's, and the TP engine's `counter` (a stats key) went up meanwhile."""
    before = tp.engine.stats()[counter]
    outs = tp.generate(prompts, params)
    assert tp.engine.stats()[counter] > before, counter
    assert token_ids(outs) == token_ids(single.generate(prompts, params))


def test_prefix_cache_hits_give_the_same_tokens(engines):
    single, tp = engines
    shared = random_prompts(4, [24], vocab=4096)[0]
    prompts = [shared + tail for tail in random_prompts(5, [3, 7, 1], vocab=4096)]
    tp.generate(prompts[:1], GREEDY)                       # the shared blocks are cached now
    assert_same_and_counted(single, tp, prompts, GREEDY, "prefix_cache_hits")


def test_preemption_gives_the_same_tokens(engines):
    single, tp = engines
    prompts = random_prompts(6, [20, 22, 24, 26, 28, 30], vocab=4096)
    params = minirt.SamplingParams(max_new_tokens=40, ignore_eos=True)   # 6 x ~17 blocks > the pool's 48
    assert_same_and_counted(single, tp, prompts, params, "num_preemptions")


def test_stop_strings_and_eos(engines):
    single, tp = engines
    prompts = ["To be, or not to be", "Of man's first disobedience", "Now is the winter"]
    free = single.generate(prompts, minirt.SamplingParams(max_new_tokens=24))
    stops = [o.text[5:9] for o in free]                    # a string each continuation does produce
    params = [minirt.SamplingParams(max_new_tokens=24, stop=[s]) for s in stops]
    outs, expected = tp.generate(prompts, params), single.generate(prompts, params)
    assert [(o.text, o.finish_reason) for o in outs] == [(o.text, o.finish_reason) for o in expected]
    assert all(o.finish_reason == "stop" and s not in o.text for o, s in zip(outs, stops))


def test_streaming_deltas_add_up_to_the_one_process_text(engines):
    single, tp = engines
    prompts = ["But soft, what light", "The quality of mercy"]
    params = minirt.SamplingParams(max_new_tokens=20)
    expected = single.generate(prompts, params)

    async def stream_all():
        async with tp.engine:
            async def one(prompt):
                text, tokens = "", []
                async for delta in tp.engine.stream(prompt, params):
                    text, tokens = text + delta.text, tokens + list(delta.token_ids)
                return text, tokens
            return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(stream_all())
    assert got == [(o.text, o.token_ids) for o in expected]


def test_a_step_runs_the_collectives_and_the_ranks_stay_up(engines):
    _, tp = engines
    runner = tp.engine.model_runner
    calls = runner.comm.calls
    tp.generate([[1, 2, 3]], minirt.SamplingParams(max_new_tokens=1))
    layers = runner.model.full_config.num_hidden_layers
    assert runner.comm.calls - calls == 1 + 2 * layers + 1          # embedding, 2 per layer, LM-head gather
    assert [p.is_alive() for p in runner.group.processes] == [True]


# ------------------------------------------------------------------------------------------ sharded layers
def _linear(i, o, bias, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    if bias:
        nn.init.normal_(lin.bias)
    return lin.requires_grad_(False)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_column_then_row_parallel_equals_the_unsharded_pair(world_size, bias):
    """Every rank's output, with its all-reduce summed over the ranks (`simulate_ranks`), equals the unsharded pair."""
    from minirt.course.checks import simulate_ranks

    first, second = _linear(16, 32, bias, 0), _linear(32, 8, bias, 1)
    x = torch.randn(3, 5, 16)
    shards = [column_parallel(first, rank, world_size)(x) for rank in range(world_size)]
    torch.testing.assert_close(torch.cat(shards, dim=-1), first(x))
    outs = simulate_ranks(lambda rank, comm: RowParallelLinear(second, rank, world_size, comm), world_size,
                          lambda rank: shards[rank])
    for out in outs:
        torch.testing.assert_close(out, second(first(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab,world_size", [(12, 2), (10, 3), (7, 4)])
def test_vocab_parallel_embedding_and_lm_head_equal_the_unsharded(vocab, world_size):
    torch.manual_seed(2)
    emb = nn.Embedding(vocab, 6).requires_grad_(False)
    head = _linear(6, vocab, False, 3)
    ids = torch.randint(0, vocab, (2, 9))
    hidden = torch.randn(4, 6)
    from minirt.course.checks import simulate_ranks

    local = Communicator()
    for out in simulate_ranks(lambda rank, comm: VocabParallelEmbedding(emb, rank, world_size, comm), world_size,
                              lambda rank: ids):
        torch.testing.assert_close(out, emb(ids))
    shards = [VocabParallelEmbedding(emb, r, world_size, local) for r in range(world_size)]
    for tied in (False, True):
        heads = [ParallelLMHead(head, r, world_size, local, shards[r] if tied else None) for r in range(world_size)]
        logits = torch.cat([h(hidden) for h in heads], dim=-1)[..., :vocab]
        torch.testing.assert_close(logits, hidden @ (emb.weight if tied else head.weight).T)


def test_a_step_survives_the_wire(engines):
    single, _ = engines
    engine = single.engine
    request = engine._add_request(list(range(1, 14)), GREEDY)
    engine.scheduler.schedule()                                        # allocate its blocks
    step = engine.model_runner.prepare_lists([(request, 9)])
    back = unpack_step(*pack_step(step))
    for name in ("input_ids", "positions", "slots", "query_start_loc", "context_lens", "block_tables",
                 "sample_rows", "max_query_len"):
        assert getattr(back, name) == getattr(step, name), name
    engine.abort(request.request_id)


# ------------------------------------------------------------------------------------------ refusals
def test_refuses_head_counts_that_do_not_divide(tiny_models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_models["qwen3"])          # 4 heads, 2 KV heads, 128 MLP channels
    with pytest.raises(ValueError, match=r"num_attention_heads = 4 is not divisible by tensor_parallel_size = 3"):
        check_shardable(config, 3)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2 is not divisible by tensor_parallel_size = 4"):
        minirt.LLM(tiny_models["qwen3"], device="cpu", tensor_parallel_size=4)
    assert multiprocessing.active_children() == before                # refused before any rank started


@pytest.mark.parametrize("settings,message", [
    (dict(tensor_parallel_size=0), r"tensor_parallel_size: must be an integer >= 1, got 0"),
    (dict(tensor_parallel_size=2, num_scheduler_steps=4),
     r"num_scheduler_steps: multi-step decode needs tensor_parallel_size=1 \(got 2"),
    (dict(tensor_parallel_size=2, gemv=True), r"gemv: .* needs .*tensor_parallel_size=1 \(got 2"),
])
def test_refuses_what_cannot_run_with_tensor_parallelism(tiny_models, settings, message):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=message):
        minirt.LLM(tiny_models["qwen2"], device="cpu", **settings)
    assert multiprocessing.active_children() == before


def test_the_plan_turns_off_what_the_ranks_cannot_run():
    from minirt.config import EngineConfig
    from minirt.fast import Hardware, resolve_plan

    cuda = Hardware("cuda")                                           # a GPU with everything: all on for one process
    assert resolve_plan(EngineConfig(), torch.device("cuda"), hardware=cuda).cuda_graphs
    plan = resolve_plan(EngineConfig(tensor_parallel_size=2), torch.device("cuda"), hardware=cuda)
    assert (plan.cuda_graphs, plan.gemv, plan.num_scheduler_steps) == (False, False, 1)
    assert plan.attention_backend == "triton" and plan.merge_projections


# ------------------------------------------------------------------------------------------ a world of one; GPUs
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (NCCL in a world of one)"))])
def test_runner_in_a_world_of_one_equals_the_reference(tiny_models, engines, device):
    """The TP runner (gloo on the CPU, NCCL on a GPU) with one rank: sharding, collectives and step path, no spawn.
    Runs after the module's TP engine is built, which holds this process's group: that one is refused first."""
    path = tiny_models["qwen2"]
    # no prefix cache: the new runner's KV cache is empty, the old one's cached blocks would be stale hits
    settings = dict(device=device, dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    if device == "cuda":        # the plan and step the TP runner runs under (fast/plan.py's RULES: no graphs, GEMVs, bursts)
        settings.update(enforce_eager=True, gemv=False, num_scheduler_steps=1)
    reference = minirt.LLM(path, **settings)
    prompts = random_prompts(8, [9, 3, 20])
    expected = token_ids(reference.generate(prompts, GREEDY))
    engine = reference.engine
    args = (engine.plan, minirt.load_model(path, device=device, dtype="float32")[0], 64, 4, 256, 512)
    _, tp = engines
    if not tp.engine.model_runner.group.closed:                       # the first of these tests
        with pytest.raises(RuntimeError, match="already holds a torch.distributed group"):
            build_tensor_parallel_runner(1, *args)
        tp.engine.model_runner.close()                                # the module's engine is done with its group
    engine.model_runner = runner = build_tensor_parallel_runner(1, *args)
    try:
        assert token_ids(reference.generate(prompts, GREEDY)) == expected
        assert runner.comm.calls == 0                                  # a world of one runs no collective
    finally:
        runner.close()
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL tensor parallelism)")
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_two_gpus_over_nccl_equal_one_gpu(tiny_models, family):
    path = tiny_models[family]
    settings = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=64)
    prompts = random_prompts(9, [9, 3, 20, 33])
    expected = token_ids(minirt.LLM(path, **settings).generate(prompts, GREEDY))
    tp = minirt.LLM(path, tensor_parallel_size=2, **settings)
    try:
        assert token_ids(tp.generate(prompts, GREEDY)) == expected
        assert expected == [hf_greedy(path, p, 16) for p in prompts]
    finally:
        tp.engine.model_runner.close()
    assert not multiprocessing.active_children()
