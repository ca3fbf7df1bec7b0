"""Async scheduling of the steps with prefill chunks (the plan's `async_scheduling`; vLLM's `--async-scheduling`,
SGLang's overlap scheduler).

An engine step (`Engine.step`) schedules, launches the forward, waits for its sampled tokens, and takes them
(postprocess); while the host schedules and prepares the next step, the GPU has nothing to do, and while the GPU
runs, the host only waits. Here the next step is scheduled and launched while the one before still runs: its
computed tokens are accounted first (`Scheduler.update_after_step`, which needs no sampled token), the next batch
is scheduled from that, and the rows of the requests the running step samples read their token on the device
(`FastModelRunner.launch_step`). Then the host takes the running step's tokens while the GPU works on the next.

What the host learns only from the tokens comes one step late: a request that stops (EOS, a stop string, its last
token) in a step is already in the next one, whose row for it computes a token the engine drops, as in a burst of
multi-step decode. Blocks stay safe: everything that reuses a freed block is launched after the step that may still
write it, on the same stream.

Only steps with a prefill chunk of two or more tokens are launched this way; the others (decodes, which bursts or the
decode graphs run from the host's tokens) first wait for the step in flight. A step that needs every token on the host
before it is scheduled (chapter 11's drafting step, `minirt.spec.engine`) first takes the step in flight and
launches nothing after it (`drain`). On with piecewise graphs (`RULES`).
"""

from __future__ import annotations

import time

from minirt.scheduler import ScheduledBatch


def has_long_chunk(batch: ScheduledBatch) -> bool:
    """Whether `FastModelRunner.launch_step` can run the batch: some row computes two or more tokens."""
    return any(n > 1 for _, n in batch.items)


class AsyncSteps:
    """The engine's single step with async scheduling: `step()` as `Engine.step` (False if nothing was
    scheduled), leaving a step with prefill chunks in flight; `busy` while one is; `drain()` takes it."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: tuple[ScheduledBatch, object] | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def step(self) -> bool:
        try:
            return self._step()
        except BaseException:
            self.in_flight = None        # the engine fails every request; nothing stays in flight
            raise

    def drain(self) -> bool:
        """Take the step in flight as `step` takes it, and launch nothing after it: then every token is on the host.
        False if none was in flight."""
        if self.in_flight is None:
            return False
        batch, running = self.in_flight
        self.in_flight = None
        self.engine.postprocess(batch, [], [], time.perf_counter())     # its computed tokens; its sampled ones below
        self._take(batch, running)
        return True

    def _step(self) -> bool:
        engine, scheduler, runner = self.engine, self.engine.scheduler, self.engine.model_runner
        if self.in_flight is None:
            batch = scheduler.schedule()
            if not batch:
                return False
            engine.start_step(batch)
            if has_long_chunk(batch):
                self.in_flight = (batch, runner.launch_step(batch.items))
            else:
                self._run(batch)
            return True
        batch, running = self.in_flight
        self.in_flight = None
        engine.postprocess(batch, [], [], time.perf_counter())      # its computed tokens; its sampled ones below
        following = None
        if scheduler.waiting_queue or scheduler.prefilling_requests:   # else decodes follow, from the host's tokens
            following = scheduler.schedule()
        if following and has_long_chunk(following):
            engine.start_step(following)
            self.in_flight = (following, runner.launch_step(following.items, previous=running))
            self._take(batch, running)
            return True
        self._take(batch, running)
        if following:
            following.items = [(r, n) for r, n in following.items if not r.is_finished]   # stopped in `batch`
            if following:
                engine.start_step(following)
                self._run(following)
        return True

    def _take(self, batch: ScheduledBatch, running) -> None:
        """The sampled tokens of a step launched before, taken as `Engine.postprocess` takes them."""
        requests, tokens = self.engine.model_runner.finish_step(running)
        self.engine.postprocess(ScheduledBatch(), requests, tokens, time.perf_counter())
        self.engine.end_step(batch)

    def _run(self, batch: ScheduledBatch) -> None:
        """A scheduled batch run as `Engine.step` runs it."""
        requests, tokens = self.engine.model_runner.execute(batch.items)
        self.engine.postprocess(batch, requests, tokens, time.perf_counter())
        self.engine.end_step(batch)
