"""Multi-step decode (EngineConfig.num_scheduler_steps, chapter 07): several decode steps per schedule, each
step's tokens fed to the next on the device, give exactly the tokens of single steps.

Oracle: transformers greedy (conftest.hf_greedy); for seeded sampling, the same engine with single steps
(the draws of each request's generator must come in the same order). Both paths run on the CPU: the eager
forward, and the static buffers of `DecodeGraphs(capture=False)`; on CUDA the captured graphs run too.
"""

import asyncio
import random

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts
from test_cuda_graphs import padded_engine

KW = dict(device="cpu", dtype=torch.float32, block_size=4)


def greedy(n, **kw):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def spy_on_bursts(llm) -> list[int]:
    """Record the step count of every `execute_decode_steps` call, and check the scheduler after every step."""
    counts = []
    runner = llm.engine.model_runner
    run = runner.execute_decode_steps

    def counting(items, num_steps):
        counts.append(num_steps)
        return run(items, num_steps)

    runner.execute_decode_steps = counting
    llm.engine.step_callbacks.append(lambda engine, batch: engine.scheduler.check_invariants())
    return counts


def build(path, how, steps, **kw):
    if how == "eager":
        return minirt.LLM(model=path, **KW, num_scheduler_steps=steps, **kw)
    return padded_engine(path, num_scheduler_steps=steps, **kw)     # the CUDA-graph path's static buffers, eagerly


@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_multi_step_equals_transformers(tiny_model_path, how):
    llm = build(tiny_model_path, how, 4, max_num_seqs=8)
    bursts = spy_on_bursts(llm)
    rng = random.Random(3)
    prompts = random_prompts(21, [rng.randint(1, 14) for _ in range(6)])
    ns = [1, 2, 5, 9, 11, 14]                         # bursts are cut to the fewest tokens any request has left
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
        assert o.finish_reason == "length"
    assert bursts and max(bursts) == 4 and min(bursts) >= 2, bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_a_stop_part_way_through_a_burst(tiny_models, how):
    """A request that hits a stop token in the middle of a burst ends there (the later tokens are dropped, its
    blocks freed) while the other request of the burst carries on unchanged."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(22, [6, 9])
    full = hf_greedy(path, prompts[0], 12)
    j = next(i for i in range(2, 12) if full[i] not in full[:i])     # tokens 1..8 come from the first burst
    llm = build(path, how, 8, max_num_seqs=4)
    bursts = spy_on_bursts(llm)
    outs = llm.generate(prompts, [greedy(12, stop_token_ids=[full[j]]), greedy(12)])
    assert outs[0].token_ids == full[:j + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == hf_greedy(path, prompts[1], 12)
    assert 8 in bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_streamed_bursts_concatenate(tiny_models):
    path = tiny_models["llama"]
    prompt = random_prompts(23, [7])[0]

    async def main():
        async with minirt.Engine(model=path, **KW, num_scheduler_steps=4) as engine:
            ids, deltas = [], []
            async for delta in engine.stream(prompt, greedy(10)):
                deltas.append(delta)
                ids.extend(delta.token_ids)
            return ids, deltas

    ids, deltas = asyncio.run(main())
    assert ids == hf_greedy(path, prompt, 10)
    assert len(deltas) >= 3 and deltas[-1].finish_reason == "length"


def test_seeded_sampling_draws_as_with_single_steps(tiny_models):
    path = tiny_models["qwen2"]
    prompts = random_prompts(24, [5, 8, 3])
    params = [minirt.SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.9, top_k=20, seed=s)
              for s in (1, 2, 3)]
    single = minirt.LLM(model=path, **KW, num_scheduler_steps=1).generate(prompts, params)
    llm = minirt.LLM(model=path, **KW, num_scheduler_steps=4)
    bursts = spy_on_bursts(llm)
    multi = llm.generate(prompts, params)
    assert [o.token_ids for o in multi] == [o.token_ids for o in single]
    assert bursts


def test_bursts_wait_for_admission(tiny_models):
    """While a request waits or prefills, steps stay single: a burst would delay its first token."""
    path = tiny_models["llama"]
    llm = build(path, "eager", 8, max_num_seqs=1)          # one seat: the second request waits for the first
    bursts = spy_on_bursts(llm)
    seen = []
    llm.engine.step_callbacks.append(
        lambda engine, batch: seen.append((len(engine.waiting_queue), engine.num_steps)))
    prompts = random_prompts(25, [5, 6])
    outs = llm.generate(prompts, [greedy(6), greedy(6)])
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, 6)
    # while the second request waited, every engine step advanced num_steps by exactly one
    waiting_steps = [n for (w, n), (_, before) in zip(seen[1:], seen) if w and n - before != 1]
    assert not waiting_steps and bursts == [5], (seen, bursts)


def test_default_and_bad_values(tiny_models):
    assert minirt.LLM(model=tiny_models["llama"], **KW).engine.plan.num_scheduler_steps == 1   # no graphs: off
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            minirt.LLM(model=tiny_models["llama"], **KW, num_scheduler_steps=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_multi_step_through_cuda_graphs(tiny_model_path):
    llm = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=16,
                     num_kv_blocks=1024)
    assert llm.engine.plan.num_scheduler_steps == 8                   # the default with graphs
    bursts = spy_on_bursts(llm)
    rng = random.Random(11)
    prompts = random_prompts(26, [rng.randint(1, 30) for _ in range(12)])
    ns = [rng.randint(1, 40) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
    assert 8 in bursts
