"""Async scheduling of the steps with prefill chunks (`minirt.fast.async_scheduling`): a step is scheduled and launched
before the host takes the tokens of the one before, and every request still gets exactly its tokens.

Oracles: transformers greedy (conftest.hf_greedy); for seeded sampling, the same engine without async scheduling
(each request's generator must draw in the same order). On the CPU the steps run eagerly (the fast runner's
staging, no graphs); on CUDA with the plan's defaults (piecewise graphs).
"""

import random

import pytest
import torch

import minirt
from conftest import hf_greedy, hold_the_gpu_after, random_prompts
from minirt.request import RequestStatus

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def greedy(n, **kw):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def build(path, device="cpu", **kw):
    dtype = torch.float32
    if device == "cpu":
        kw.setdefault("num_scheduler_steps", 1)
    return minirt.LLM(model=path, device=device, dtype=dtype, block_size=4, async_scheduling=True, **kw)


def spy(llm) -> dict:
    """Count the steps launched by `launch_step` with and without a step in flight before them, and check the
    scheduler's bookkeeping after every engine step."""
    runner, counts = llm.engine.model_runner, {"after_one_in_flight": 0, "alone": 0}
    launch = runner.launch_step

    def launching(items, previous=None):
        counts["alone" if previous is None else "after_one_in_flight"] += 1
        return launch(items, previous)

    runner.launch_step = launching
    llm.engine.step_callbacks.append(lambda engine, batch: engine.scheduler.check_invariants())
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_async_steps_equal_transformers(tiny_model_path, device):
    """Chunked prefill in small steps (16 tokens, chunks of at most 6) while earlier requests decode: most steps are
    launched while the one before runs, and their decode rows read that step's tokens on the device. Requests of one
    token end in their prefill's step while the next step already holds them."""
    llm = build(tiny_model_path, device, max_num_seqs=6, max_num_batched_tokens=16, max_prefill_chunk=6)
    counts = spy(llm)
    rng = random.Random(7)
    prompts = random_prompts(17, [rng.randint(2, 23) for _ in range(14)])
    ns = [1, 2, 3] + [rng.randint(1, 12) for _ in prompts[3:]]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
        assert o.finish_reason == "length"
    assert counts["after_one_in_flight"] >= 10, counts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_stop_found_one_step_late(tiny_models):
    """A request that meets a stop token in a step with prefill chunks is already in the next step, launched before
    its token was seen: that step's row for it is dropped, and nothing else changes."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(41, [5, 30, 28, 26])            # the long prompts keep steps with chunks going
    full = hf_greedy(path, prompts[0], 12)
    j = next(i for i in range(1, 6) if full[i] not in full[:i])
    llm = build(path, max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=4)
    counts = spy(llm)
    outs = llm.generate(prompts, [greedy(12, stop_token_ids=[full[j]])] + [greedy(6)] * 3)
    assert outs[0].token_ids == full[:j + 1] and outs[0].finish_reason == "stop"
    for p, o in zip(prompts[1:], outs[1:]):
        assert o.token_ids == hf_greedy(path, p, 6)
    assert counts["after_one_in_flight"] > 0, counts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preemption_with_a_step_in_flight(tiny_models):
    """A pool too small for every request: scheduling the next step preempts requests that the step in flight
    computes (their blocks are reused only by steps launched after it); each still gets transformers' tokens."""
    path = tiny_models["llama"]
    rng = random.Random(3)
    prompts = random_prompts(43, [rng.randint(6, 16) for _ in range(8)])
    ns = [rng.randint(6, 14) for _ in prompts]
    llm = build(path, max_num_seqs=8, max_num_batched_tokens=12, max_prefill_chunk=5, num_kv_blocks=16)
    counts = spy(llm)
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(path, p, n)
    assert llm.engine.scheduler.num_preemptions > 0 and counts["after_one_in_flight"] > 0, counts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_seeded_sampling_as_without_async_scheduling(tiny_models):
    """Seeded sampling draws each request's tokens in the same order: the same text as the engine without async
    scheduling, for requests of different temperatures and top-k/top-p in one batch."""
    path = tiny_models["qwen2"]
    prompts = random_prompts(44, [9, 14, 4, 11, 7])
    params = [minirt.SamplingParams(max_new_tokens=10, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in [(0.8, 0, 1.0, 1), (1.2, 5, 1.0, 2), (0.0, 0, 1.0, 3), (1.0, 0, 0.9, 4), (0.7, 3, 0.8, 5)]]
    kw = dict(max_num_seqs=5, max_num_batched_tokens=10, max_prefill_chunk=4)
    llm = build(path, **kw)
    counts = spy(llm)
    got = llm.generate(prompts, params)
    assert counts["after_one_in_flight"] > 0, counts
    want = minirt.LLM(model=path, device="cpu", dtype=torch.float32, block_size=4, async_scheduling=False, **kw
                      ).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_with_bursts_of_multi_step_decode(tiny_models):
    """With bursts too: a burst starts only once the step in flight has been taken."""
    path = tiny_models["qwen3"]
    rng = random.Random(8)
    prompts = random_prompts(45, [rng.randint(3, 20) for _ in range(7)])
    ns = [rng.randint(2, 15) for _ in prompts]
    llm = build(path, max_num_seqs=4, max_num_batched_tokens=12, max_prefill_chunk=6, num_scheduler_steps=4)
    counts = spy(llm)
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(path, p, n)
    assert counts["after_one_in_flight"] > 0, counts


def test_abort_while_a_step_is_in_flight(tiny_models):
    """The async engine: a request aborted while a step that computes it is in flight (the callback runs after the
    next step was launched) ends "abort"; the others get transformers' tokens and every block is free at the end."""
    import asyncio

    path = tiny_models["llama"]
    prompts = random_prompts(46, [20, 18, 22])
    engine = minirt.Engine(model=path, device="cpu", dtype=torch.float32, block_size=4, async_scheduling=True,
                           num_scheduler_steps=1, max_num_batched_tokens=8, max_prefill_chunk=4)
    launched, aborted_in_flight = [], []
    launch = engine.model_runner.launch_step

    def launching(items, previous=None):
        launched.append({r.request_id for r, _ in items})
        return launch(items, previous)

    def abort_once(eng, batch):
        eng.scheduler.check_invariants()
        if len(launched) == 3 and not aborted_in_flight:
            aborted_in_flight.append("victim" in launched[-1])
            eng.abort("victim")

    engine.model_runner.launch_step = launching
    engine.step_callbacks.append(abort_once)

    async def main():
        async with engine:
            return await asyncio.gather(*(engine.generate(p, greedy(5), request_id=rid)
                                          for p, rid in zip(prompts, ["a", "victim", "b"])))

    outs = asyncio.run(main())
    assert aborted_in_flight == [True], launched
    assert outs[1].finish_reason == "abort"
    assert outs[0].token_ids == hf_greedy(path, prompts[0], 5) and outs[2].token_ids == hf_greedy(path, prompts[2], 5)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preempted_and_readmitted_while_its_token_is_in_flight(tiny_models):
    """Scheduling the next step preempts a request whose token the step in flight samples, and readmits it in the
    same schedule: its prefill chunk then ends before the token not known yet (no row of it is filled on the
    device), and it decodes that token in a later step, as without async scheduling."""
    path = tiny_models["llama"]
    prompts, ns = random_prompts(25, [5, 8, 9]), [10, 3, 7]
    llm = build(path, max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=6, num_kv_blocks=4,
                enable_prefix_caching=False)
    engine, seen = llm.engine, []
    launch = engine.model_runner.launch_step

    def launching(items, previous=None):
        if previous is not None:      # a request the step before samples, prefilling again: preempted, readmitted
            seen.extend(r.request_id for r, _ in items
                        if r in previous.requests and r.status == RequestStatus.PREFILLING)
        return launch(items, previous)

    engine.model_runner.launch_step = launching
    engine.step_callbacks.append(lambda e, b: e.scheduler.check_invariants())
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    assert seen, "no request was preempted and readmitted while its token was in flight"
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(path, p, n) and o.finish_reason == "length"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_bursts_wait_for_a_step_in_flight_whose_prefill_was_aborted(tiny_models, overlap):
    """The only prefilling request is aborted while a step with its chunk is in flight: what is left is decodes
    alone, which a burst would run from the host's state before the step in flight is accounted and taken; bursts
    wait for it (`BurstSteps.busy`), and the other requests get transformers' tokens."""
    path = tiny_models["llama"]
    prompts = random_prompts(46, [3, 4, 30])
    llm = build(path, num_scheduler_steps=4, overlap_scheduling=overlap, max_num_batched_tokens=8,
                max_prefill_chunk=4)
    engine, launched, aborted = llm.engine, [], []
    launch = engine.model_runner.launch_step

    def launching(items, previous=None):
        launched.append({r.request_id: r for r, _ in items})
        return launch(items, previous)

    def abort_victim(eng, batch):
        eng.scheduler.check_invariants()
        victim = (launched[-1] if launched else {}).get("req-2")
        if not aborted and victim is not None and victim.status == RequestStatus.PREFILLING \
                and victim.num_computed_tokens >= 8:
            aborted.append(eng.abort("req-2"))

    engine.model_runner.launch_step = launching
    engine.step_callbacks.append(abort_victim)
    outs = llm.generate(prompts, [greedy(n) for n in (20, 20, 5)])
    assert aborted == [True] and outs[2].finish_reason == "abort"
    for p, o in zip(prompts[:2], outs[:2]):
        assert o.token_ids == hf_greedy(path, p, 20)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_step_snapshots_match_their_own_steps(tiny_models):
    """`minirt.course.workloads.observe_steps` with async scheduling, where the next step is scheduled before this
    one ends: each snapshot gets its own step's end and outputs (the requests it scheduled), not the next one's."""
    from minirt.course.workloads import observe_steps

    path = tiny_models["llama"]
    llm = build(path, max_num_batched_tokens=8, max_prefill_chunk=4)
    counts = spy(llm)
    with observe_steps(llm.engine) as snapshots:
        llm.generate(random_prompts(1, [12, 9, 10]), [greedy(4)] * 3)
    assert counts["after_one_in_flight"] > 0, counts
    assert [s.step for s in snapshots] == list(range(len(snapshots)))
    for s in snapshots:
        assert s.end_s > s.start_s and set(s.num_output) == set(s.scheduled), s.step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_taking_a_steps_tokens_does_not_wait_for_the_next_step(tiny_model_path):
    """The point of it: the host takes a step's tokens while the GPU runs the step launched after it. The GPU is
    kept busy for about a second (`torch.cuda._sleep`) right after one step launched behind another; taking the
    tokens of the one before must return while the sleep still runs."""
    llm = build(tiny_model_path, "cuda", max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=8)
    seen = hold_the_gpu_after(llm.engine.model_runner, "launch_step", "finish_step",
                              when=lambda items, previous=None: previous is not None)
    prompts = random_prompts(47, [30, 25, 28])
    outs = llm.generate(prompts, [greedy(4)] * 3)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_model_path, p, 4)
    assert seen == [False], "taking the step's tokens waited for the step launched after it"
