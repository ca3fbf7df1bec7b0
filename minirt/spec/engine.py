"""Chapter 11: speculative decoding in the engine - draft, schedule the drafts as rows, verify in one forward,
keep what the acceptance rule keeps, roll the KV blocks back.

Each engine step (`SpeculativeSteps.step`, which `minirt.fast.FastEngine.choose_step` picks when the plan's
`speculative` is set) first decides, from the state, whether it drafts: only while the running batch is at most the
plan's `speculative_max_batch` (above it, verifying k+1 rows of every request costs more than it saves once the step
is no longer bound by reading the weights). A step that drafts nothing (a larger batch, or no draft proposed) runs
exactly as the plain engine's step function runs it (`plain_step`: chapter 07's bursts of multi-step decode, overlap
and async scheduling where the plan has them), and may leave work in flight. A drafting step continues every
request's tokens, so they must all be on the host: what the plain steps left in flight is taken first, launching
nothing after it (`drain`, a step of its own). Then:

1. **draft**: the drafter (`minirt.spec.proposer`) proposes up to k tokens for each running request;
2. **schedule** (`SpeculativeScheduler.schedule`, chapter 06's rules): a running request with a draft of m tokens
   computes m+1 rows, its last token and the draft, positions `num_computed_tokens ..` (prefill-like rows of one
   sequence); the token budget counts them all. The last token's slot is made as chapter 06 makes a decode's
   (preempting the newest requests if the pool is empty); a draft gets slots only from blocks free above the
   watermark and is cut to fit them and the budget (preempting a request to check a guess would cost more than
   the guess can save);
3. **verify**: one forward over the batch; every row of a draft is scored (`SpeculativeSteps.verify`). A greedy
   request keeps the longest prefix of its draft equal to the target's argmax, then the target's own token
   (`greedy_accept`); a sampled one runs rejection sampling with its own generator (`rejection_sample`), so its
   tokens are distributed exactly as without a draft. With the plan's verify_graphs, a step of running requests
   only replays one CUDA graph of k+1 rows per request, a shorter draft padded with rows whose K/V goes to a scratch
   slot and which acceptance never sees (`minirt.fast.runner.FastModelRunner.forward_verify`);
4. **postprocess**: the kept tokens are appended one at a time with chapter 05's stop checks (EOS, stop ids, stop
   strings, max_new_tokens): the first that finishes the request ends it and the rest are discarded. The request
   counts as computed its last token and the drafts it kept; the blocks past its tokens are released
   (`rollback_block_table`). The rows of rejected drafts wrote K/V into slots past `num_computed_tokens`, which
   the prefix cache never hashes (it registers blocks full of computed tokens only) and the next step overwrites.

vLLM v1 runs the same loop (`SpecDecodeMetadata`, its `RejectionSampler`, the scheduler's `spec_token_ids`
counted in the token budget), drafting after the forward for the next step; here the draft is made at the start of
the step from the tokens the request has, which is why a drafting step waits for the steps in flight while the
others overlap (vLLM's `disable_by_batch_size` turns drafting off by batch size the same way).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from minirt.config import cdiv
from minirt.fast.multi_step import BurstScheduler
from minirt.request import Request, RequestStatus
from minirt.sampling import filter_logits
from minirt.scheduler import ScheduledBatch, split_budget
from minirt.spec.acceptance import greedy_accept, rejection_sample
from minirt.spec.proposer import Proposer
from minirt.spec.rollback import rollback_block_table


class SpeculativeScheduler(BurstScheduler):
    """Chapter 06's scheduler, whose running requests compute their draft tokens as extra rows; with `max_steps`
    > 1 it also grants bursts of multi-step decode (`BurstScheduler`) to the steps that draft nothing.

    `drafts` maps a running request to its draft for the next `schedule` (the step fills it); `schedule` cuts each
    draft to what it schedules. `on_remove(request)` is called whenever a request leaves (finished, aborted,
    preempted): the drafter's `remove` hook."""

    def __init__(self, config, pool, prefix_cache, max_steps: int = 1):
        super().__init__(config, pool, prefix_cache, max_steps)
        self.drafts: dict[Request, list[int]] = {}
        self.on_remove = None

    def schedule(self) -> ScheduledBatch:
        """Chapter 06's `schedule`, a running request with a draft of m tokens getting m+1 rows (module docstring,
        step 2): each draft is cut to the budget left after one token for every later running request, and to the
        slots free blocks above the watermark give it."""
        cfg = self.config
        batch = ScheduledBatch()
        num_tokens = 0
        i = 0
        while i < len(self.running_requests) and num_tokens < cfg.max_num_batched_tokens:
            request = self.running_requests[i]
            if not self.ensure_decode_slot(request):      # may preempt newer requests, or this one
                continue
            later = len(self.running_requests) - i - 1
            m = min(len(self.drafts.get(request, ())), cfg.max_num_batched_tokens - num_tokens - 1 - later)
            m = self.draft_slots(request, m)
            if m > 0:
                self.drafts[request] = self.drafts[request][:m]
            else:
                self.drafts.pop(request, None)
            batch.items.append((request, 1 + m))
            batch.num_decodes += 1
            num_tokens += 1 + m
            i += 1
        _, chunks = split_budget(
            cfg.max_num_batched_tokens, num_tokens,
            [r.num_prefill_tokens - r.num_computed_tokens for r in self.prefilling_requests], cfg.max_prefill_chunk)
        batch.items += [(r, n) for r, n in zip(self.prefilling_requests, chunks) if n > 0]
        budget = cfg.max_num_batched_tokens - batch.num_tokens
        while (self.waiting_queue and budget > 0
               and len(self.prefilling_requests) + len(self.running_requests) < cfg.max_num_seqs):
            request = self.waiting_queue[0]
            if not self.try_allocate(request):
                break
            self.waiting_queue.popleft()
            request.status = RequestStatus.PREFILLING
            self.prefilling_requests.append(request)
            n = min(request.num_prefill_tokens - request.num_computed_tokens, cfg.max_prefill_chunk, budget)
            batch.items.append((request, n))
            budget -= n
        return batch

    def draft_slots(self, request: Request, num_draft: int) -> int:
        """Give `request` slots for up to `num_draft` draft tokens after its last token (whose slot it has), from
        blocks free above the watermark only; returns how many it got (<= num_draft, >= 0)."""
        if num_draft <= 0:
            return 0
        B = self.config.block_size
        need = cdiv(request.num_computed_tokens + 1 + num_draft, B)
        while len(request.block_table) < need and self.pool.num_free_blocks > self.watermark_blocks:
            request.block_table.append(self.pool.allocate())
        return min(num_draft, len(request.block_table) * B - request.num_computed_tokens - 1)

    def remove(self, request: Request) -> None:
        """Chapter 05's `remove` (blocks freed), its draft dropped and the drafter told (`on_remove`)."""
        super().remove(request)
        self.drafts.pop(request, None)
        if self.on_remove is not None:
            self.on_remove(request)


class SpeculativeSteps:
    """The engine's step with speculative decoding (see the module docstring): `step()` returns False if nothing
    was scheduled, as `Engine.step` does. `proposer`: the drafter; `num_speculative_tokens`: k;
    `max_batch`: the running batch above which no step drafts; `plain_step`: the plain engine's step function, which
    runs the steps that draft nothing (default `Engine.step`); `drain`: takes what `plain_step` left in flight and
    launches nothing after it, False if nothing was (`BurstSteps.drain`, `AsyncSteps.drain`; default: nothing is
    ever in flight). Counts, since the engine started: `num_drafts` (verified drafts, one per request and step),
    `num_draft_tokens` (their tokens), `num_accepted_tokens` (those the acceptance rule kept, before stop checks),
    `num_target_forwards` (a request sampled in a verification step, draft or none) and `num_emitted_tokens` (the
    tokens those gave, before stop checks): their ratio is the tokens per target forward."""

    def __init__(self, engine, proposer: Proposer, num_speculative_tokens: int, max_batch: int,
                 plain_step: Callable[[], bool] | None = None, drain: Callable[[], bool] | None = None):
        self.engine, self.proposer = engine, proposer
        self.k, self.max_batch = num_speculative_tokens, max_batch
        self.plain_step = plain_step or engine.step
        self.drain = drain or (lambda: False)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_target_forwards = self.num_emitted_tokens = 0
        engine.scheduler.on_remove = proposer.remove

    def stats(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens, "spec_num_target_forwards":
                self.num_target_forwards, "spec_num_emitted_tokens": self.num_emitted_tokens}

    def drafting(self) -> bool:
        """Whether this step may draft: some request runs, and at most `max_batch` do."""
        return 0 < len(self.engine.scheduler.running_requests) <= self.max_batch

    def step(self) -> bool:
        """One engine step: `plain_step` where it may not draft; else `drain` if something is in flight (a step of
        its own), else draft, schedule, verify and postprocess (`plain_step` if no draft was proposed)."""
        if not self.drafting():
            return self.plain_step()
        if self.drain():                   # the drafts continue every token: those in flight are taken first
            return True
        engine, scheduler = self.engine, self.engine.scheduler
        try:
            self.draft()
            if not scheduler.drafts:       # nothing to verify: a plain step, bursts and overlap included
                return self.plain_step()
            batch = scheduler.schedule()
            if not batch:
                return False
            engine.start_step(batch)
            emitted = self.verify(batch)
            self.postprocess(batch, emitted, time.perf_counter())
        finally:
            scheduler.drafts.clear()
        engine.end_step(batch)
        return True

    def draft(self) -> None:
        """Ask the drafter for each running request's draft (at most k, and fewer than the tokens it may still
        generate: the step emits up to one more), while the running batch is at most `max_batch`."""
        if not self.drafting():
            return
        running = self.engine.scheduler.running_requests
        limits = [min(self.k, r.params.max_new_tokens - r.num_output_tokens - 1) for r in running]
        wanted = [(r, k) for r, k in zip(running, limits) if k > 0]
        if not wanted:
            return
        drafts = self.proposer.propose([r for r, _ in wanted], [k for _, k in wanted])
        for (request, k), draft in zip(wanted, drafts):
            if draft:
                self.engine.scheduler.drafts[request] = [int(t) for t in draft[:k]]

    @torch.inference_mode()
    def verify(self, batch: ScheduledBatch) -> dict[Request, list[int]]:
        """One forward over the batch, every draft row scored: the tokens each sampled request emits (1 .. m+1 for
        a draft of m; a prefill chunk that does not end its prompt emits none and is absent)."""
        runner, drafts = self.engine.model_runner, self.engine.scheduler.drafts
        for request, n in batch.items:
            if n > 1 and request in drafts:
                request.token_ids += drafts[request]          # the draft rows, read by prepare_lists
        try:
            step = runner.prepare_lists(batch.items)
        finally:
            for request, n in batch.items:
                if n > 1 and request in drafts:
                    del request.token_ids[-len(drafts[request]):]
        rows, spans = [], []
        for request, row in zip(step.sample_requests, step.sample_rows):
            m = len(drafts.get(request, ()))
            spans.append((request, len(rows), m))
            rows += range(row - m, row + 1)
        if not rows:
            runner.forward(step)
            return {}
        step.sample_rows = rows
        step.sample_requests = [request for request, _, m in spans for _ in range(m + 1)]
        # Running requests only: one CUDA graph of k+1 rows each, shorter drafts padded (the plan's verify_graphs)
        graphed = self.engine.plan.verify_graphs and batch.num_decodes == len(batch.items)
        hidden = runner.forward_verify(step) if graphed else runner.forward(step)
        logits = runner.model.compute_logits(hidden)                      # [num_rows, vocab]
        return self.accept(logits, spans)

    def accept(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> dict[Request, list[int]]:
        """The tokens each request keeps from its rows `logits[start : start + m + 1]` (a draft of m tokens):
        `greedy_accept` on the argmax, or `rejection_sample` on the target's filtered distribution with the
        request's generator."""
        drafts = self.engine.scheduler.drafts
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [(r, start, m) for r, start, m in spans if not r.params.greedy]
        probs = {}
        if sampled:
            index = torch.tensor([start + j for _, start, m in sampled for j in range(m + 1)], device=logits.device)
            per_row = [r.params for r, _, m in sampled for _ in range(m + 1)]
            dev = logits.device
            temperature = torch.tensor([p.temperature for p in per_row], dtype=torch.float32, device=dev)
            top_k = torch.tensor([p.top_k for p in per_row], dtype=torch.long, device=dev)
            top_p = torch.tensor([p.top_p for p in per_row], dtype=torch.float32, device=dev)
            p = filter_logits(logits[index] / temperature[:, None], top_k, top_p).softmax(dim=-1)
            at = 0
            for request, _, m in sampled:
                probs[request] = p[at:at + m + 1]
                at += m + 1
        emitted = {}
        for request, start, m in spans:
            draft = drafts.get(request, [])
            if request.params.greedy:
                emitted[request] = greedy_accept(draft, argmax[start:start + m + 1])
            else:
                q = self.proposer.draft_probs(request) if m else None
                if q is not None:
                    q = q[:m].to(probs[request].device)
                emitted[request] = rejection_sample(draft, q, probs[request], request.generator)
            self.num_target_forwards += 1
            self.num_emitted_tokens += len(emitted[request])
            if m:
                self.num_drafts += 1
                self.num_draft_tokens += m
                self.num_accepted_tokens += len(emitted[request]) - 1
        return emitted

    def postprocess(self, batch: ScheduledBatch, emitted: dict[Request, list[int]], now: float) -> None:
        """Account, append and finish as `Engine.postprocess`, a verified request's tokens one at a time (module
        docstring, step 4); then roll back what its rejected drafts held."""
        engine, scheduler = self.engine, self.engine.scheduler
        B = engine.config.block_size
        for request, n in batch.items:
            if request.is_finished:
                continue
            tokens = emitted.get(request)
            if request.status != RequestStatus.RUNNING or tokens is None:
                scheduler.update_after_step(request, n)       # a prefill chunk (maybe the last): as chapter 05
                if tokens is not None:
                    self._append(request, tokens[:1], now)
                continue
            accepted = len(tokens) - 1                        # the drafts kept; the last token is the target's
            appended = 0
            for token in tokens:
                request.append_token(token, now)
                appended += 1
                if request.finish_reason is not None:
                    break
            # K/V kept: the last token's and those of the kept drafts appended (the target's own token has none)
            scheduler.update_after_step(request, 1 + min(appended, accepted))
            if request.finish_reason is not None:
                engine._finish(request, request.finish_reason)
                continue
            rollback_block_table(request.block_table, engine.pool, len(request.token_ids), B)
            self.proposer.rollback(request, len(request.token_ids) - 1)
            self._stream(request)

    def _append(self, request: Request, tokens: list[int], now: float) -> None:
        for token in tokens:
            request.append_token(token, now)
            if request.finish_reason is not None:
                self.engine._finish(request, request.finish_reason)
                return
        self._stream(request)

    @staticmethod
    def _stream(request: Request) -> None:
        if request.stream is not None:
            delta = request.stream_delta()
            if delta is not None:
                request.stream.put_nowait(delta)
