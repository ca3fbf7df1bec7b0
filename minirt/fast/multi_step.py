"""Multi-step decode: when every admitted request is decoding, one engine step runs several decode steps back to
back on the device, and the engine takes their tokens in order, as if from single steps (vLLM 0.6's
`--num-scheduler-steps`). `BurstScheduler` decides how many and allocates their blocks (the scheduler owns the
blocks); `BurstSteps` is the engine's step that runs them (`FastEngine.choose_step` picks it once).

Overlap scheduling (the plan's `overlap_scheduling`; SGLang's overlap scheduler, vLLM's async scheduling): while a
burst runs, the host has nothing to do but wait for its tokens, and while the host takes them (postprocess) and
prepares the next burst, the GPU has nothing to do. When the next burst would run the same requests, it is launched
first, from the inputs the running burst leaves on the device (`BurstScheduler.decode_steps_after`); then the host
reads the running burst's tokens while the GPU works on the next. A step that needs every token on the host first
(chapter 11's drafting step) takes the burst in flight and launches none after it (`BurstSteps.drain`)."""

from __future__ import annotations

import time

from minirt.config import EngineConfig, cdiv
from minirt.kv.block_pool import BlockPool
from minirt.kv.prefix_cache import PrefixCache
from minirt.scheduler import ScheduledBatch, Scheduler


class BurstScheduler(Scheduler):
    """Chapter 06's scheduler, which also grants bursts of up to `max_steps` decode steps, with their blocks."""

    def __init__(self, config: EngineConfig, pool: BlockPool, prefix_cache: PrefixCache, max_steps: int):
        super().__init__(config, pool, prefix_cache)
        self.max_steps = max_steps

    def decode_steps_ahead(self) -> int:
        """How many decode steps the next engine step may run back to back, with the blocks for all of them
        allocated here; 1 means an ordinary step.

        More than one only when every admitted request is decoding, none waits (a burst delays admission),
        they fit the token budget, and the free blocks cover every request's new tokens without preemption.
        The count never exceeds `max_steps`, the most tokens any request may still generate, nor the positions any
        request has left before `max_model_len` (the block tables' width). A request with fewer tokens to go ends
        part-way through, as at a stop (EOS, a stop string): its row computes tokens the engine drops, while the
        others go on (vLLM's multi-step ran all k steps and dropped the surplus the same way). Cutting every burst
        to the fewest tokens any request has left instead turns a batch whose requests end one after another (as
        requests admitted step by step do) into single steps, each paying the host's work between them.
        """
        running = self.running_requests
        if (self.max_steps < 2 or self.waiting_queue or self.prefilling_requests or not running
                or len(running) > self.config.max_num_batched_tokens):
            return 1
        return self._allocate_steps(0)

    def decode_steps_after(self, batch: ScheduledBatch, in_flight: int) -> int:
        """How many decode steps may follow a burst of `in_flight` steps of `batch` that the engine has not taken
        the tokens of yet, launched before it does, with their blocks allocated here; 1 means none (the burst's
        tokens are taken first, and the next step is scheduled as usual).

        More than one only when the burst's requests are still exactly the admitted ones, all decoding and none
        finished (a stop in the burst in flight is found only when its tokens are taken: the steps after it compute
        tokens the engine drops, as within a burst, and so do those after a request's last token), none waits,
        some request may still generate that many tokens after the `in_flight` ones, none runs past
        `max_model_len`, and the free blocks cover them. Blocks are only ever allocated by the scheduler, here and
        in `schedule`, and neither happens while a request that finished may still write K/V into blocks it freed:
        once one has finished, the next call returns 1 and the engine waits for the steps in flight before it
        schedules again.
        """
        if (self.max_steps < 2 or self.waiting_queue or self.prefilling_requests
                or len(self.running_requests) != len(batch.items) or any(r.is_finished for r, _ in batch.items)):
            return 1
        return self._allocate_steps(in_flight)

    def _allocate_steps(self, in_flight: int) -> int:
        """The decode steps the running requests may take after their `in_flight` ones not yet counted (at most
        `max_steps`, the most tokens any may still generate, the positions any has left; see
        `decode_steps_ahead`), with their blocks allocated; 1 (nothing allocated) if that is fewer than 2 or the
        free blocks do not cover them."""
        running, cfg = self.running_requests, self.config
        tokens_left = max(r.params.max_new_tokens - r.num_output_tokens - in_flight for r in running)
        steps = min(self.max_steps, tokens_left)
        if cfg.max_model_len is not None:         # None: a scheduler built without an engine, no length limit
            steps = min(steps, *(cfg.max_model_len - r.num_computed_tokens - in_flight for r in running))
        B = cfg.block_size
        missing = [cdiv(r.num_computed_tokens + in_flight + steps, B) - len(r.block_table) for r in running]
        if steps < 2 or sum(m for m in missing if m > 0) > self.pool.num_free_blocks:
            return 1
        for request, m in zip(running, missing):
            request.block_table += [self.pool.allocate() for _ in range(m)]
        return steps


class BurstSteps:
    """The engine's step with multi-step decode: `step()` runs a burst of decode steps whenever the engine's
    `BurstScheduler` grants one (with the runner's `execute_decode_steps`, `minirt.fast.runner.FastModelRunner`)
    and a single step otherwise; `overlapped_step()` does the same with overlap scheduling (see the module
    docstring). The single steps are `Engine.step`, or with the plan's `async_scheduling` `async_steps.step`
    (`minirt.fast.async_scheduling.AsyncSteps`), and a burst waits for the single step in flight to be taken
    first. Both return False if nothing was scheduled, as `Engine.step` does. `drain()` takes whatever either
    left in flight and launches nothing after it."""

    def __init__(self, engine, async_steps=None):
        self.engine, self.async_steps = engine, async_steps
        self.single_step = engine.step if async_steps is None else async_steps.step
        self.in_flight = None                     # overlap scheduling: (batch, burst) launched, tokens not taken

    def busy(self) -> bool:
        """Whether a single step is in flight (async scheduling)."""
        return self.async_steps is not None and self.async_steps.busy

    def step(self) -> bool:
        engine = self.engine
        if self.busy():
            return self.single_step()
        num_steps = engine.scheduler.decode_steps_ahead()
        if num_steps == 1:
            return self.single_step()
        batch = engine.scheduler.schedule()
        engine.start_step(batch)
        self.take_tokens(batch, *engine.model_runner.execute_decode_steps(batch.items, num_steps))
        return True

    def overlapped_step(self) -> bool:
        """`step` with overlap scheduling: a burst is launched and left in flight; each step launches the burst
        after it where `decode_steps_after` allows, then takes the tokens of the one in flight. The runner's
        `start_decode_steps`, `continue_decode_steps` and `finish_decode_steps` launch and read them."""
        engine = self.engine
        scheduler, runner = engine.scheduler, engine.model_runner
        if self.in_flight is None and self.busy():
            return self.single_step()
        try:
            if self.in_flight is None:
                num_steps = scheduler.decode_steps_ahead()
                if num_steps == 1:
                    return self.single_step()
                batch = scheduler.schedule()
                engine.start_step(batch)
                self.in_flight = (batch, runner.start_decode_steps(batch.items, num_steps))
            batch, burst = self.in_flight
            more = scheduler.decode_steps_after(batch, len(burst.tokens))
            following = runner.continue_decode_steps(burst, more) if more > 1 else None
            requests, token_steps = runner.finish_decode_steps(burst)
        except BaseException:
            self.in_flight = None                 # the engine fails every request; nothing stays in flight
            raise
        self.in_flight = (batch, following) if following is not None else None
        self.take_tokens(batch, requests, token_steps)
        return True

    def drain(self) -> bool:
        """Take the tokens of what is in flight, a burst (overlap scheduling) or a single step (async scheduling), as
        the next step would, and launch nothing after it: then every token is on the host, as a step that drafts
        from them needs (chapter 11, `minirt.spec.engine`). False if nothing was in flight."""
        if self.in_flight is None:
            return self.async_steps is not None and self.async_steps.drain()
        batch, burst = self.in_flight
        self.in_flight = None
        self.take_tokens(batch, *self.engine.model_runner.finish_decode_steps(burst))
        return True

    def take_tokens(self, batch: ScheduledBatch, requests, token_steps: list[list[int]]) -> None:
        """The engine takes a burst's tokens step by step, exactly as from single steps (`Engine.postprocess`),
        and counts its steps: `token_steps[i][j]` is step i's token for `requests[j]`."""
        engine = self.engine
        now = time.perf_counter()                 # the burst's tokens arrive together
        for tokens in token_steps:
            engine.postprocess(batch, requests, tokens, now)
        engine.num_steps += len(token_steps) - 1  # end_step counts the first
        engine.end_step(batch)
