"""Load: 2,000 concurrent requests with random lengths and sampling, 20% cancelled or timed out at
random moments (waiting, mid-prefill, mid-decode), on a pool small enough to force preemption.

Afterwards every future is resolved, no block leaked, the invariants hold at every step, and every
surviving greedy request equals its solo run (the contiguous-KV-cache path, an independent code path
checked against transformers in test_equality.py).
"""

from __future__ import annotations

import asyncio
import random

import pytest

import minirt
from minirt.generate import kv_cache_generate
from minirt.request import RequestStatus

NUM_REQUESTS = 2000


@pytest.fixture(scope="module")
def load_run(tiny_models):
    rng = random.Random(1234)
    engine = minirt.Engine(tiny_models["qwen3"], block_size=4, num_kv_blocks=160, max_num_seqs=64,
                           max_num_batched_tokens=96, max_prefill_chunk=16, dtype="float32")
    vocab = engine.model.config.vocab_size
    jobs = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        greedy = rng.random() < 0.5
        params = minirt.SamplingParams(
            max_new_tokens=rng.randint(1, 24), ignore_eos=True,
            temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.5]),
            top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5]),
            seed=rng.choice([None, rng.randrange(1 << 30)]))
        fate = rng.random()
        # 10% cancelled once seen in a chosen collection, 10% with a timeout that may or may not fire
        cancel_at = rng.choice(list(RequestStatus)[:3]) if fate < 0.10 else None
        timeout = rng.uniform(0.01, 2.0) if 0.10 <= fate < 0.20 else None
        jobs.append((f"r{i}", prompt, params, cancel_at, timeout))

    statuses_at_cancel: list[RequestStatus] = []
    invariant_failures: list[str] = []

    async def main():
        async with engine:
            tasks = {}
            for rid, prompt, params, _, timeout in jobs:
                tasks[rid] = asyncio.create_task(engine.generate(prompt, params, request_id=rid, timeout=timeout))
            cancels = {rid: status for rid, _, _, status, _ in jobs if status is not None}
            original_step = engine.step_fn

            def observed_step():
                progressed = original_step()
                try:
                    engine.scheduler.check_invariants()
                except AssertionError as e:
                    invariant_failures.append(str(e))
                for rid, status in list(cancels.items()):
                    request = engine.requests.get(rid)
                    if request is None:               # finished (or timed out) before its moment came
                        del cancels[rid]
                    elif request.status == status:
                        statuses_at_cancel.append(status)
                        tasks[rid].cancel()
                        del cancels[rid]
                return progressed

            engine.step_fn = observed_step
            results = await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 600)
            return dict(zip(tasks, results)), engine.stats()

    results, stats = asyncio.run(main())
    return engine, jobs, results, stats, statuses_at_cancel, invariant_failures


def test_every_request_resolves_and_nothing_leaks(load_run):
    engine, jobs, results, stats, _, invariant_failures = load_run
    assert len(results) == NUM_REQUESTS
    for rid, result in results.items():
        assert isinstance(result, (minirt.RequestOutput, asyncio.CancelledError, TimeoutError)), (rid, result)
        if isinstance(result, minirt.RequestOutput):
            assert result.finish_reason == "length", (rid, result.finish_reason, result.error)
    assert not invariant_failures, invariant_failures[:3]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_waiting"] == stats["num_prefilling"] == stats["num_running"] == 0
    assert engine.requests == {}
    engine.scheduler.check_invariants()


def test_load_exercised_cancellation_everywhere_and_preemption(load_run):
    _, _, results, stats, statuses_at_cancel, _ = load_run
    kinds = {type(r).__name__ for r in results.values()}
    assert {"RequestOutput", "CancelledError"} <= kinds
    assert {RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.RUNNING} <= set(statuses_at_cancel)
    assert stats["num_preemptions"] > 0
    cancelled = sum(not isinstance(r, minirt.RequestOutput) for r in results.values())
    assert 0.05 * NUM_REQUESTS < cancelled <= 0.20 * NUM_REQUESTS


def test_surviving_greedy_requests_equal_solo_runs(load_run):
    engine, jobs, results, _, _, _ = load_run
    checked = 0
    for rid, prompt, params, _, _ in jobs:
        out = results[rid]
        if not isinstance(out, minirt.RequestOutput) or params.temperature != 0:
            continue
        solo = kv_cache_generate(engine.model, [prompt], params.max_new_tokens)[0]
        assert out.token_ids == solo, rid
        checked += 1
    assert checked > 0.3 * NUM_REQUESTS
