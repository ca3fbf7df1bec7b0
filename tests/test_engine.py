"""The asyncio engine: timeouts, block accounting, stats, streaming, fail-fast on device OOM."""

import asyncio

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts

ENGINE_KW = dict(device="cpu", dtype=torch.float32, block_size=4)
LIMIT = 120  # seconds: nothing may hang


def greedy(n):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True)


def _assert_all_free(engine):
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_waiting"] == stats["num_prefilling"] == stats["num_running"] == 0, stats


def test_stats_keys(tiny_models):
    async def main():
        async with minirt.Engine(model=tiny_models["llama"], **ENGINE_KW, num_kv_blocks=50) as engine:
            stats = engine.stats()
            for key in ("num_total_blocks", "num_free_blocks", "num_waiting", "num_prefilling", "num_running"):
                assert key in stats and isinstance(stats[key], int), key
            assert stats["num_total_blocks"] == 50
            _assert_all_free(engine)

    asyncio.run(main())


def test_concurrent_generate_and_blocks_freed(tiny_models):
    path = tiny_models["llama"]
    prompts = random_prompts(1000, [3, 9, 14, 22, 5, 30])
    ns = [4, 12, 7, 3, 15, 9]

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW) as engine:
            seen_busy = []

            async def watch():
                while True:
                    s = engine.stats()
                    seen_busy.append(s["num_free_blocks"] < s["num_total_blocks"])
                    await asyncio.sleep(0)

            watcher = asyncio.ensure_future(watch())
            outs = await asyncio.wait_for(
                asyncio.gather(*(engine.generate(p, greedy(n)) for p, n in zip(prompts, ns))), LIMIT)
            watcher.cancel()
            for p, n, o in zip(prompts, ns, outs):
                assert list(o.token_ids) == hf_greedy(path, p, n)
                assert o.finish_reason == "length"
                m = o.metrics
                assert m.e2e_s is not None and m.ttft_s is not None and 0 <= m.ttft_s <= m.e2e_s
                assert m.queue_s is not None and 0 <= m.queue_s <= m.ttft_s
                assert (m.tpot_s is None) if n == 1 else (m.tpot_s is not None and m.tpot_s >= 0)
            assert any(seen_busy), "blocks were never in use?"
            _assert_all_free(engine)

    asyncio.run(main())


def test_timeout_raises_to_that_caller_only(tiny_models):
    path = tiny_models["qwen3"]
    (long_p, other_p) = random_prompts(1010, [12, 7])

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW) as engine:
            other = asyncio.ensure_future(engine.generate(other_p, greedy(20)))
            with pytest.raises(TimeoutError):
                # far more work than fits in the timeout
                await engine.generate(long_p, greedy(400), timeout=0.05)
            out = await asyncio.wait_for(other, LIMIT)
            assert list(out.token_ids) == hf_greedy(path, other_p, 20) and out.finish_reason == "length"
            # the timed-out request left every collection and freed its blocks
            for _ in range(50):
                s = engine.stats()
                if s["num_free_blocks"] == s["num_total_blocks"]:
                    break
                await asyncio.sleep(0.01)
            _assert_all_free(engine)
            # and the engine still serves
            out = await asyncio.wait_for(engine.generate(long_p, greedy(5)), LIMIT)
            assert list(out.token_ids) == hf_greedy(path, long_p, 5)
            _assert_all_free(engine)

    asyncio.run(main())


def test_timeout_while_waiting(tiny_models):
    """A request that times out while still queued (max_num_seqs=1) leaves the queue; the rest complete."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(1020, [5, 6, 7])

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW, max_num_seqs=1) as engine:
            first = asyncio.ensure_future(engine.generate(prompts[0], greedy(300)))
            await asyncio.sleep(0)
            with pytest.raises(TimeoutError):
                await engine.generate(prompts[1], greedy(5), timeout=0.01)
            third = asyncio.ensure_future(engine.generate(prompts[2], greedy(4)))
            a, c = await asyncio.wait_for(asyncio.gather(first, third), LIMIT)
            assert list(a.token_ids) == hf_greedy(path, prompts[0], 300)
            assert list(c.token_ids) == hf_greedy(path, prompts[2], 4)
            _assert_all_free(engine)

    asyncio.run(main())


def test_cancelled_caller_frees_blocks(tiny_models):
    path = tiny_models["qwen3"]
    (p,) = random_prompts(1030, [10])

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW) as engine:
            task = asyncio.ensure_future(engine.generate(p, greedy(300)))
            for _ in range(5):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            out = await asyncio.wait_for(engine.generate(p, greedy(3)), LIMIT)
            assert list(out.token_ids) == hf_greedy(path, p, 3)
            _assert_all_free(engine)

    asyncio.run(main())


def test_streaming_deltas_concatenate(tiny_models):
    path = tiny_models["qwen2"]
    prompts = random_prompts(1040, [4, 11])

    async def consume(engine, prompt, n):
        ids, deltas = [], []
        async for delta in engine.stream(prompt, greedy(n)):
            deltas.append(delta)
            ids.extend(delta.token_ids)
        return ids, deltas

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW) as engine:
            results = await asyncio.wait_for(
                asyncio.gather(consume(engine, prompts[0], 9), consume(engine, prompts[1], 13)), LIMIT)
            for p, n, (ids, deltas) in zip(prompts, (9, 13), results):
                assert ids == hf_greedy(path, p, n)
                assert len(deltas) >= 2, "streaming should deliver tokens incrementally"
                assert deltas[-1].finish_reason == "length"
                assert all(getattr(d, "finish_reason", None) is None for d in deltas[:-1])
            _assert_all_free(engine)

    asyncio.run(main())


def test_streaming_text_matches_generate(default_model):
    prompt = "ROMEO:"

    async def main():
        async with minirt.Engine(model=default_model, device="cpu", dtype="float32") as engine:
            full = await asyncio.wait_for(engine.generate(prompt, greedy(30)), LIMIT)
            text, ids, last = "", [], None
            async for delta in engine.stream(prompt, greedy(30)):
                text += delta.text
                ids.extend(delta.token_ids)
                last = delta
            assert ids == list(full.token_ids)
            assert text == full.text
            assert last.finish_reason == full.finish_reason == "length"
            # with a stop string, the streamed text never shows it either
            stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
            if stop.strip():
                cut = await asyncio.wait_for(
                    engine.generate(prompt, minirt.SamplingParams(max_new_tokens=30, ignore_eos=True, stop=stop)),
                    LIMIT)
                streamed = ""
                async for delta in engine.stream(prompt, minirt.SamplingParams(max_new_tokens=30, ignore_eos=True,
                                                                               stop=stop)):
                    streamed += delta.text
                    assert stop not in streamed
                assert streamed == cut.text and stop not in cut.text
            _assert_all_free(engine)

    asyncio.run(main())


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected by the test)")


@pytest.mark.parametrize("when", ["first_step", "mid_decode"])
def test_oom_fails_every_in_flight_request(tiny_models, monkeypatch, when):
    path = tiny_models["llama"]
    prompts = random_prompts(1050, [5, 9, 13, 3])

    async def main():
        async with minirt.Engine(model=path, **ENGINE_KW) as engine:
            model = engine.model_runner.model
            if when == "first_step":
                monkeypatch.setattr(model, "forward", _oom)
                tasks = [asyncio.ensure_future(engine.generate(p, greedy(30))) for p in prompts]
            else:
                tasks = [asyncio.ensure_future(engine.generate(p, greedy(200))) for p in prompts]
                for _ in range(200):  # let some decoding happen
                    await asyncio.sleep(0.005)
                    if engine.stats()["num_running"] > 0:
                        break
                monkeypatch.setattr(model, "forward", _oom)
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), LIMIT)
            for out in done:
                assert not isinstance(out, BaseException), repr(out)
                assert out.finish_reason == "error"
                assert out.error and isinstance(out.error, str)
                assert "memory" in out.error.lower()
            monkeypatch.undo()
            # after the failure: either the engine recovered and serves, or it refuses clearly - never hangs
            try:
                out = await asyncio.wait_for(engine.generate(prompts[0], greedy(3)), LIMIT)
            except (RuntimeError, ValueError):
                return
            assert out.finish_reason in ("length", "error")
            if out.finish_reason == "length":
                assert list(out.token_ids) == hf_greedy(path, prompts[0], 3)
                _assert_all_free(engine)

    asyncio.run(main())


def test_llm_exposes_engine(tiny_models):
    llm = minirt.LLM(model=tiny_models["llama"], **ENGINE_KW)
    assert isinstance(llm.engine, minirt.engine.Engine)       # chapter 05's, built on (`minirt.Engine` builds it)
    outs = llm.generate(random_prompts(1060, [4]), greedy(2))
    assert len(outs) == 1 and isinstance(outs[0], minirt.RequestOutput)
    _assert_all_free(llm.engine)


def test_llm_generate_runs_in_the_calling_thread_without_an_event_loop(tiny_models, monkeypatch):
    """`LLM.generate` drives the engine's steps itself (nano-vllm's loop): no helper thread, no event loop; the
    tokens are transformers' and every block is free afterwards. While the engine's asyncio loop runs, it refuses."""
    import threading

    llm = minirt.LLM(model=tiny_models["llama"], **ENGINE_KW)
    prompts = random_prompts(1061, [3, 8])
    want = [hf_greedy(tiny_models["llama"], p, 5) for p in prompts]           # the oracle loads with threads
    monkeypatch.setattr(threading.Thread, "start", lambda self: pytest.fail("LLM.generate started a thread"))
    monkeypatch.setattr(asyncio, "new_event_loop", lambda: pytest.fail("LLM.generate made an event loop"))
    monkeypatch.setattr(asyncio, "run", lambda *a, **k: pytest.fail("LLM.generate ran an event loop"))
    outs = llm.generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == want
    _assert_all_free(llm.engine)
    monkeypatch.undo()

    async def while_the_loop_runs():
        async with llm.engine:
            with pytest.raises(RuntimeError, match="the engine's asyncio loop is running"):
                llm.generate(prompts, greedy(2))

    asyncio.run(while_the_loop_runs())


def test_llm_generate_inside_running_loop_does_not_hang(tiny_models, tmp_path):
    """LLM.generate is synchronous; called where an event loop already runs (as in Jupyter) it must work or
    refuse with RuntimeError, never deadlock. Run in a subprocess so that a hang cannot block the suite."""
    import subprocess
    import sys

    script = tmp_path / "in_loop.py"
    script.write_text(f"""
import asyncio, sys, torch, minirt
llm = minirt.LLM(model={tiny_models["llama"]!r}, device="cpu", dtype=torch.float32, block_size=4)
async def main():
    try:
        outs = llm.generate([[1, 2, 3, 4]], minirt.SamplingParams(max_new_tokens=2, ignore_eos=True))
    except RuntimeError as e:
        print("REFUSED", e)
        return
    print("OK", list(outs[0].token_ids))
asyncio.run(main())
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(("OK", "REFUSED")), proc.stdout
    if last.startswith("OK"):
        assert last == f"OK {hf_greedy(tiny_models['llama'], [1, 2, 3, 4], 2)}"


@pytest.mark.parametrize("seed", [0, 1])
def test_stress_invariants_with_timeouts_cancels_and_preemption(tiny_models, seed):
    """A random mix of requests, timeouts and cancellations on a tight pool: bookkeeping invariants hold
    after every step, completed greedy outputs equal transformers, and everything is freed at the end."""
    import random

    path = tiny_models["qwen3"]
    rng = random.Random(seed)
    prefixes = random_prompts(1100 + seed, [12, 20])

    def make_prompt():
        base = rng.choice(prefixes + [[]])
        return (base[:rng.randint(0, len(base))] + random_prompts(rng.randrange(10**6), [rng.randint(1, 14)])[0])

    async def main():
        async with minirt.Engine(model=path, device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=20,
                                 max_num_batched_tokens=16, max_prefill_chunk=6, max_num_seqs=6) as engine:
            check = getattr(engine.scheduler, "check_invariants", None) if hasattr(engine, "scheduler") else None
            original_step = engine.step_fn
            steps = [0]

            def checked_step():
                progressed = original_step()
                steps[0] += 1
                if check is not None:
                    check()
                return progressed

            engine.step_fn = checked_step

            async def client(i):
                await asyncio.sleep(rng.random() * 0.05)
                p, n = make_prompt(), rng.randint(1, 16)
                kind = rng.random()
                if kind < 0.2:
                    try:
                        out = await engine.generate(p, greedy(n + 40), timeout=0.005 + rng.random() * 0.03)
                    except TimeoutError:
                        return None
                    return p, n + 40, out
                if kind < 0.35:
                    task = asyncio.ensure_future(engine.generate(p, greedy(n + 40)))
                    await asyncio.sleep(rng.random() * 0.03)
                    task.cancel()
                    try:
                        return p, n + 40, await task
                    except asyncio.CancelledError:
                        return None
                return p, n, await engine.generate(p, greedy(n))

            results = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(30))), LIMIT)
            completed = [r for r in results if r is not None]
            assert len(completed) >= 15
            for p, n, out in completed:
                assert out.finish_reason == "length", (out.finish_reason, out.error)
                assert list(out.token_ids) == hf_greedy(path, p, n)
            assert steps[0] > 0
            _assert_all_free(engine)
            if check is not None:
                check()

    asyncio.run(main())


def test_interrupting_llm_generate_under_a_running_loop_stops_it(tiny_models):
    """As in Jupyter: `LLM.generate` called from inside a running event loop, then "interrupt kernel"
    (SIGINT -> KeyboardInterrupt in the main thread). The generation stops within a few steps, every
    request is aborted and every block is free, and the next call works."""
    import os
    import signal
    import time

    llm = minirt.LLM(model=tiny_models["llama"], dtype="float32", block_size=4)
    prompts = random_prompts(1200, [5, 9, 13])
    full = minirt.SamplingParams(max_new_tokens=400, ignore_eos=True)

    async def cell():            # a notebook cell: synchronous code on the kernel's running loop
        return llm.generate(prompts, full)

    def interrupt_at_step_20(engine, batch):   # the user presses "interrupt" while it generates
        if engine.num_steps >= 20 and not sent:  # (>=: a multi-step burst advances num_steps by several)
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    sent = []

    llm.engine.step_callbacks.append(interrupt_at_step_20)
    loop = asyncio.new_event_loop()          # no asyncio.run: it would turn SIGINT into a task cancel
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(cell())
    llm.engine.step_callbacks.clear()
    elapsed = time.perf_counter() - start
    loop.close()
    stats = llm.engine.stats()
    assert stats["num_steps"] < 400, "the generation ran to the end before the interrupt was seen"
    assert elapsed < 30
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_waiting"] == stats["num_prefilling"] == stats["num_running"] == 0
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_models["llama"], p, 3) for p in prompts]


def test_an_interrupt_inside_a_step_waits_for_the_step_to_end(tiny_models):
    """SIGINT in the middle of a step's bookkeeping (here: while the scheduler allocates a block) is held until the
    step is over, then raised: no block is left allocated to nobody, the bookkeeping is consistent, and the next
    call works. An interrupt while `generate` enqueues its requests leaves none of them behind."""
    import os
    import signal

    llm = minirt.LLM(model=tiny_models["llama"], dtype="float32", block_size=4)
    engine = llm.engine
    prompts = random_prompts(1201, [9, 13, 6])
    allocate, calls = engine.pool.allocate, []

    def allocate_then_interrupt():
        calls.append(1)
        if len(calls) == 3:                       # inside Scheduler.try_allocate, between two allocations
            os.kill(os.getpid(), signal.SIGINT)
        return allocate()

    engine.pool.allocate = allocate_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(50))
    engine.pool.allocate = allocate
    engine.scheduler.check_invariants()
    _assert_all_free(engine)
    assert not engine.requests and not engine.scheduler.has_work()

    add, added = engine._enqueue, []

    def add_then_interrupt(*args):
        added.append(add(*args))
        if len(added) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return added[-1]

    engine._enqueue = add_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(5))
    del engine._enqueue
    assert not engine.requests and not engine.scheduler.has_work()
    _assert_all_free(engine)
    outs = llm.generate(prompts, greedy(4))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_models["llama"], p, 4) for p in prompts]


def test_default_pool_of_a_model_without_layers():
    """No layers means no K/V bytes per token: the pool is sized to one request of max_model_len, no division by 0."""
    from types import SimpleNamespace

    from minirt.engine import default_num_kv_blocks

    config = SimpleNamespace(num_hidden_layers=0, num_key_value_heads=2, head_dim=32, hidden_size=64,
                             num_attention_heads=2)
    assert default_num_kv_blocks(config, torch.float32, torch.device("cpu"), 16, 100, 4) == 7
