"""Multi-step decode: when every admitted request is decoding, one engine step runs several decode steps back to
back on the device, and the engine takes their tokens in order, as if from single steps (vLLM 0.6's
`--num-scheduler-steps`). `build_step` picks the engine's step function once, at construction.

Overlap scheduling (the plan's `overlap_scheduling`; SGLang's overlap scheduler, vLLM's async scheduling): while a
burst runs, the host has nothing to do but wait for its tokens, and while the host takes them (postprocess) and
prepares the next burst, the GPU has nothing to do. When the next burst would run the same requests, it is launched
first, from the inputs the running burst leaves on the device (`decode_steps_after`); then the host reads the
running burst's tokens while the GPU works on the next."""

from __future__ import annotations

import time

from minirt.config import cdiv
from minirt.scheduler import Scheduler


def decode_steps_ahead(scheduler: Scheduler, max_steps: int) -> int:
    """How many decode steps the next engine step may run back to back, with the blocks for all of them
    allocated here; 1 means an ordinary step.

    More than one only when every admitted request is decoding, none waits (a burst delays admission),
    they fit the token budget, and the free blocks cover every request's new tokens without preemption.
    The count never exceeds `max_steps`, the most tokens any request may still generate, nor the positions any
    request has left before `max_model_len` (the block tables' width). A request with fewer tokens to go ends
    part-way through, as at a stop (EOS, a stop string): its row computes tokens the engine drops, while the
    others go on (vLLM's multi-step ran all k steps and dropped the surplus the same way). Cutting every burst to
    the fewest tokens any request has left instead turns a batch whose requests end one after another (as
    requests admitted step by step do) into single steps, each paying the host's work between them.
    """
    running = scheduler.running_requests
    if (max_steps < 2 or scheduler.waiting_queue or scheduler.prefilling_requests or not running
            or len(running) > scheduler.config.max_num_batched_tokens):
        return 1
    return _allocate_steps(scheduler, 0, max_steps)


def _allocate_steps(scheduler: Scheduler, in_flight: int, max_steps: int) -> int:
    """The decode steps the running requests may take after their `in_flight` ones not yet counted (at most
    max_steps, the most tokens any may still generate, the positions any has left; see `decode_steps_ahead`), with
    their blocks allocated; 1 (nothing allocated) if that is fewer than 2 or the free blocks do not cover them."""
    running = scheduler.running_requests
    cfg = scheduler.config
    tokens_left = max(r.params.max_new_tokens - r.num_output_tokens - in_flight for r in running)
    steps = min(max_steps, tokens_left)
    if cfg.max_model_len is not None:             # None: a scheduler built without an engine, no length limit
        steps = min(steps, *(cfg.max_model_len - r.num_computed_tokens - in_flight for r in running))
    B = cfg.block_size
    missing = [cdiv(r.num_computed_tokens + in_flight + steps, B) - len(r.block_table) for r in running]
    if steps < 2 or sum(m for m in missing if m > 0) > scheduler.pool.num_free_blocks:
        return 1
    for request, m in zip(running, missing):
        request.block_table += [scheduler.pool.allocate() for _ in range(m)]
    return steps


def decode_steps_after(scheduler: Scheduler, batch, in_flight: int, max_steps: int) -> int:
    """How many decode steps may follow a burst of `in_flight` steps of `batch` that the engine has not taken the
    tokens of yet, launched before it does, with their blocks allocated here; 1 means none (the burst's tokens are
    taken first, and the next step is scheduled as usual).

    More than one only when the burst's requests are still exactly the admitted ones, all decoding and none
    finished (a stop in the burst in flight is found only when its tokens are taken: the steps after it compute
    tokens the engine drops, as within a burst, and so do those after a request's last token), none waits, some
    request may still generate that many tokens after the `in_flight` ones, none runs past `max_model_len`, and the
    free blocks cover them. Blocks are only ever allocated here and in scheduling, and
    neither happens while a request that finished may still write K/V into blocks it freed: once one has finished,
    the next call returns 1 and the engine waits for the steps in flight before it schedules again.
    """
    if (max_steps < 2 or scheduler.waiting_queue or scheduler.prefilling_requests
            or len(scheduler.running_requests) != len(batch.items) or any(r.is_finished for r, _ in batch.items)):
        return 1
    return _allocate_steps(scheduler, in_flight, max_steps)


def build_step(engine):
    """The engine's step: `Engine.step` where the plan runs single steps, else a step that runs a burst of up to
    `plan.num_scheduler_steps` decode steps whenever it can (with the runner's `execute_decode_steps`,
    `minirt.fast.runner.FastModelRunner`) and a single `Engine.step` otherwise. With the plan's
    `async_scheduling`, the single steps are `minirt.fast.async_scheduling.AsyncSteps.step`, and a burst waits for
    the single step in flight to be taken first."""
    max_steps = engine.plan.num_scheduler_steps
    single_step = type(engine).step.__get__(engine)     # the class's, even where an engine's step was swapped
    busy = lambda: False                                 # noqa: E731 - a single step in flight
    if engine.plan.async_scheduling:
        from minirt.fast.async_scheduling import AsyncSteps

        steps = AsyncSteps(engine)
        single_step, busy = steps.step, lambda: steps.busy
    if max_steps == 1:
        return single_step
    if engine.plan.overlap_scheduling:
        return _overlapped_step(engine, max_steps, single_step, busy)

    def multi_step() -> bool:
        if busy():
            return single_step()
        num_steps = decode_steps_ahead(engine.scheduler, max_steps)
        if num_steps == 1:
            return single_step()
        batch = engine.scheduler.schedule()
        engine.start_step(batch)
        take_tokens(engine, batch, *engine.model_runner.execute_decode_steps(batch.items, num_steps))
        return True

    return multi_step


def take_tokens(engine, batch, requests, token_steps: list[list[int]]) -> None:
    """The engine takes a burst's tokens step by step, exactly as from single steps (`Engine.postprocess`), and
    counts its steps: `token_steps[i][j]` is step i's token for `requests[j]`."""
    now = time.perf_counter()                    # the burst's tokens arrive together
    for tokens in token_steps:
        engine.postprocess(batch, requests, tokens, now)
    engine.num_steps += len(token_steps) - 1     # end_step counts the first
    engine.end_step(batch)


def _overlapped_step(engine, max_steps: int, single_step, busy):
    """`build_step`'s multi-step decode with overlap scheduling (see the module docstring): a burst is launched
    and left in flight; each step launches the burst after it where `decode_steps_after` allows, then takes the
    tokens of the one in flight. The runner's `start_decode_steps`, `continue_decode_steps` and
    `finish_decode_steps` (`minirt.fast.runner.FastModelRunner`) launch and read them."""
    in_flight = None                                 # (batch, burst): launched, its tokens not taken yet

    def overlapped_step() -> bool:
        nonlocal in_flight
        runner = engine.model_runner
        if in_flight is None and busy():
            return single_step()
        try:
            if in_flight is None:
                num_steps = decode_steps_ahead(engine.scheduler, max_steps)
                if num_steps == 1:
                    return single_step()
                batch = engine.scheduler.schedule()
                engine.start_step(batch)
                in_flight = (batch, runner.start_decode_steps(batch.items, num_steps))
            batch, burst = in_flight
            more = decode_steps_after(engine.scheduler, batch, len(burst.tokens), max_steps)
            following = runner.continue_decode_steps(burst, more) if more > 1 else None
            requests, token_steps = runner.finish_decode_steps(burst)
        except BaseException:
            in_flight = None                         # the engine fails every request; nothing stays in flight
            raise
        in_flight = (batch, following) if following is not None else None
        take_tokens(engine, batch, requests, token_steps)
        return True

    return overlapped_step
