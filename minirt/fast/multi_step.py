"""Multi-step decode: when every admitted request is decoding, one engine step runs several decode steps back to
back on the device, and the engine takes their tokens in order, as if from single steps (vLLM 0.6's
`--num-scheduler-steps`). `build_step` picks the engine's step function once, at construction."""

from __future__ import annotations

import time

from minirt.config import cdiv
from minirt.scheduler import Scheduler


def decode_steps_ahead(scheduler: Scheduler, max_steps: int) -> int:
    """How many decode steps the next engine step may run back to back, with the blocks for all of them
    allocated here; 1 means an ordinary step.

    More than one only when every admitted request is decoding, none waits (a burst delays admission),
    they fit the token budget, and the free blocks cover every request's new tokens without preemption.
    The count never exceeds `max_steps` nor the tokens any request may still generate, so only a stop
    (EOS, a stop string) can end a request part-way through. The price of that rule: one request near its
    `max_new_tokens` shortens (or, with one token left, cancels) the burst of all the others; vLLM ran all
    k steps instead and dropped the surplus tokens.
    """
    running = scheduler.running_requests
    if (max_steps < 2 or scheduler.waiting_queue or scheduler.prefilling_requests or not running
            or len(running) > scheduler.config.max_num_batched_tokens):
        return 1
    steps = min(max_steps, *(r.params.max_new_tokens - r.num_output_tokens for r in running))
    B = scheduler.config.block_size
    missing = [cdiv(r.num_computed_tokens + steps, B) - len(r.block_table) for r in running]
    if steps < 2 or sum(m for m in missing if m > 0) > scheduler.pool.num_free_blocks:
        return 1
    for request, m in zip(running, missing):
        request.block_table += [scheduler.pool.allocate() for _ in range(m)]
    return steps


def build_step(engine):
    """The engine's step: `Engine.step` where the plan runs single steps, else a step that runs a burst of up to
    `plan.num_scheduler_steps` decode steps whenever it can (with the runner's `execute_decode_steps`,
    `minirt.fast.runner.FastModelRunner`) and a single `Engine.step` otherwise."""
    max_steps = engine.plan.num_scheduler_steps
    single_step = type(engine).step.__get__(engine)     # the class's, even where an engine's step was swapped
    if max_steps == 1:
        return single_step

    def multi_step() -> bool:
        num_steps = decode_steps_ahead(engine.scheduler, max_steps)
        if num_steps == 1:
            return single_step()
        batch = engine.scheduler.schedule()
        engine.start_step(batch)
        requests, token_steps = engine.model_runner.execute_decode_steps(batch.items, num_steps)
        now = time.perf_counter()                    # the burst's tokens arrive together
        for tokens in token_steps:
            engine.postprocess(batch, requests, tokens, now)
        engine.num_steps += num_steps - 1            # end_step counts the first
        engine.end_step(batch)
        return True

    return multi_step
