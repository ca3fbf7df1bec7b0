"""Faults injected into the forward pass mid-step: every in-flight request resolves with
finish_reason="error" and a message; new submissions are refused with a clear error until the engine
is restarted; a restarted engine serves correctly (greedy equal to transformers) with all blocks free."""

from __future__ import annotations

import asyncio

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts

KW = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_prefill_chunk=8, dtype="float32")


class InjectedError(Exception):
    pass


FAULTS = {
    "oom": (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"), "out of memory"),
    "generic": (lambda: InjectedError("boom (injected)"), "InjectedError"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("at_step", [1, 4])
def test_fault_mid_step_resolves_everything_then_restart_serves(tiny_models, fault, at_step):
    path = tiny_models["qwen2"]
    prompts = random_prompts(77, [30, 3, 17, 9, 25, 12])
    make_error, expected_text = FAULTS[fault]

    async def main():
        engine = minirt.Engine(path, **KW)
        async with engine:
            model = engine.model_runner.model
            real_forward = model.forward
            calls = {"n": 0}

            def faulty_forward(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == at_step:
                    raise make_error()
                return real_forward(*args, **kwargs)

            model.forward = faulty_forward
            tasks = [asyncio.ensure_future(engine.generate(p, minirt.SamplingParams(max_new_tokens=20,
                                                                                     ignore_eos=True)))
                     for p in prompts]
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert [o.finish_reason for o in outs] == ["error"] * len(prompts)
            assert all(expected_text in o.error for o in outs)
            assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
            assert engine.stats()["num_waiting"] == engine.stats()["num_running"] == 0
            with pytest.raises(minirt.EngineFailedError, match="restart"):
                await engine.generate(prompts[0], minirt.SamplingParams(max_new_tokens=2))
            del model.forward                                  # the fault goes away
            await engine.restart()
            outs = await asyncio.wait_for(asyncio.gather(*(
                engine.generate(p, minirt.SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts)), 60)
            for p, o in zip(prompts, outs):
                assert o.finish_reason == "length"
                assert o.token_ids == hf_greedy(path, p, 6)
            engine.scheduler.check_invariants()
            assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]

    asyncio.run(main())


def test_llm_after_a_fault_serves_the_next_call(tiny_models):
    """`LLM.generate` starts the engine for each call, so a failed call does not poison the next one."""
    path = tiny_models["llama"]
    llm = minirt.LLM(path, **KW)
    prompts = random_prompts(78, [5, 11])
    model = llm.engine.model_runner.model

    def boom(*args, **kwargs):
        raise InjectedError("boom")

    model.forward = boom
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=4))
    assert [o.finish_reason for o in outs] == ["error", "error"]
    del model.forward
    outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 4) for p in prompts]


def test_a_broken_loop_outside_a_step_still_resolves_every_request(tiny_models):
    """A failure in the loop's own bookkeeping (here: the scheduler's has_work, which runs outside a step)
    must not leave any caller waiting."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(79, [4, 9, 14])

    async def main():
        engine = minirt.Engine(path, **KW)
        async with engine:
            calls = {"n": 0}
            real_has_work = engine.scheduler.has_work

            def has_work():
                calls["n"] += 1
                if calls["n"] == 3:
                    raise InjectedError("bookkeeping broke (injected)")
                return real_has_work()

            engine.scheduler.has_work = has_work
            outs = await asyncio.wait_for(asyncio.gather(*(
                engine.generate(p, minirt.SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts)), 60)
            assert [o.finish_reason for o in outs] == ["error"] * len(prompts)
            assert all("bookkeeping broke" in o.error for o in outs)
            del engine.scheduler.has_work
        await engine.start()                  # a fresh start serves again
        try:
            out = await asyncio.wait_for(engine.generate(prompts[0], minirt.SamplingParams(max_new_tokens=4,
                                                                                             ignore_eos=True)), 60)
            assert out.token_ids == hf_greedy(path, prompts[0], 4)
        finally:
            await engine.shutdown()

    asyncio.run(main())
