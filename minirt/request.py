"""Chapter 05: a request's life - its state, its stop conditions, its metrics, and what the caller gets back.

A request moves through the engine's three collections: `waiting_queue` -> `prefilling_requests`
-> `running_requests`, then leaves with a `RequestOutput`. Everything the scheduler and the model
runner need about it lives on the `Request` object itself (nano-vllm's `Sequence`, vLLM's `Request`):
its tokens, how many of them have K/V in the cache (`num_computed_tokens`), and its block table.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import torch

from minirt.detokenize import IncrementalDetokenizer
from minirt.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # in waiting_queue, no blocks
    PREFILLING = "prefilling"    # admitted: blocks held, prompt K/V being computed (maybe in chunks)
                                 # (after a preemption, the generated tokens are prefilled too)
    RUNNING = "running"          # prompt done, one new token per step (decode)
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request latencies in seconds, measured with `time.perf_counter` from arrival.

    queue_s: arrival -> first scheduled (time in the waiting queue).
    ttft_s: time to first token, arrival -> first output token.
    tpot_s: time per output token, the mean gap between consecutive output tokens,
            `(t_last - t_first) / (n - 1)`; None when only one token was generated.
    e2e_s: arrival -> finished.
    token_times_s: arrival -> each output token, one entry per token (their gaps are the inter-token
                   latencies, whose maximum shows a decode stalled behind a long prefill). Tokens that the
                   engine postprocesses together share one time.
    None where the request never got that far (for example aborted while waiting).
    """

    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What `generate` returns. `token_ids` and `text` hold the generated part only.

    finish_reason: "stop" (EOS, a stop string or a stop id), "length" (max_new_tokens), "abort"
    (cancelled or timed out), "error" (the engine failed; `error` says why).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_cached_tokens: int = 0


@dataclass
class StreamDelta:
    """One piece of a streamed request: the new token ids and text since the last delta.

    The last delta has `finished=True`, the `finish_reason`, and the full `output`.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None


class Request:
    """One generation request inside the engine."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: frozenset[int], tokenizer=None,
                 device: torch.device | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output, grows by one per decode
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0        # tokens whose K/V are in the cache
        self.num_cached_tokens = 0          # of those, served by the prefix cache
        self.num_registered_blocks = 0      # full blocks already hashed into the prefix cache
        self.num_prefill_tokens = len(prompt_token_ids)   # tokens to prefill once admitted (+ output if preempted)
        self.num_preemptions = 0
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self._stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)   # one set lookup per token
        self.tokenizer = tokenizer
        self.text = ""
        self.detokenizer: IncrementalDetokenizer | None = None   # made at the first token, if text is needed then
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and params.temperature > 0:
            self.generator = torch.Generator(device=device or "cpu").manual_seed(params.seed)
        self.future: asyncio.Future | None = None
        self.stream: asyncio.Queue | None = None
        self._streamed_tokens = 0
        self._streamed_chars = 0
        # Characters at the end that could still be the start of a stop string: not streamed, searched again.
        self._stop_hold = max((len(s) for s in params.stop), default=1) - 1
        self._checked_chars = 0             # settled text already searched for stop strings
        self.arrival_time = time.perf_counter()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    # ------------------------------------------------------------------ views
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    # ------------------------------------------------------------------ decode bookkeeping
    def append_token(self, token_id: int, now: float) -> None:
        """Add one sampled token, then decide whether the request is done (sets `finish_reason`).

        Every token's text is searched for stop strings, whatever else ends the request with it, and `text` is
        cut before the earliest one: text never contains a stop string. `finish_reason` is "stop" for EOS, a
        stop id or a stop string, and "length" (the `max_new_tokens`-th token) only if none of these.
        """
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_times.append(now)
        p = self.params
        if (p.stop or self.stream is not None) and self.tokenizer is not None:
            self._detokenize(token_id)
            if p.stop:
                self._check_stop_strings()
        if token_id in self._stop_ids:
            self.finish_reason = "stop"
        if self.finish_reason is None and self.num_output_tokens >= p.max_new_tokens:
            self.finish_reason = "length"

    def _detokenize(self, token_id: int) -> None:
        """Keep `text` equal to the decoded output, a token at a time (`minirt.detokenize`: linear time)."""
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.detokenizer.append(token_id)
        self.text = self.detokenizer.text

    def _check_stop_strings(self) -> None:
        # Only the end can hold a new match: the settled text before it was searched in earlier steps, and
        # the unsettled rest (a character still being completed) is searched again until it settles.
        search_from = max(0, self._checked_chars - self._stop_hold)
        hits = [i for s in self.params.stop if (i := self.text.find(s, search_from)) >= 0]
        self._checked_chars = self.detokenizer.num_settled_chars
        if hits:
            self.text = self.text[:min(hits)]      # a stop string never appears in the output text
            self.finish_reason = "stop"

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark finished (the engine frees the blocks and resolves the future)."""
        if self.finish_reason is None or reason in ("abort", "error"):
            self.finish_reason = reason
        self.error = error
        self.status = RequestStatus.FINISHED
        self.finish_time = time.perf_counter()
        if self.detokenizer is None and self.tokenizer is not None:     # text not kept token by token: decode once
            self.text = self.tokenizer.decode(self.output_token_ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ results
    def metrics(self) -> RequestMetrics:
        a = self.arrival_time
        n = self.num_output_tokens
        return RequestMetrics(
            queue_s=None if self.scheduled_time is None else self.scheduled_time - a,
            ttft_s=None if self.first_token_time is None else self.first_token_time - a,
            tpot_s=(self.last_token_time - self.first_token_time) / (n - 1) if n > 1 and self.first_token_time else None,
            e2e_s=None if self.finish_time is None else self.finish_time - a,
            token_times_s=[t - a for t in self.token_times],
        )

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids, text=self.text, finish_reason=self.finish_reason, error=self.error,
            metrics=self.metrics(), num_cached_tokens=self.num_cached_tokens)

    def stream_delta(self) -> StreamDelta | None:
        """The part not yet streamed; text that is not settled yet (an unfinished character,
        `minirt.detokenize`) or that could still turn out to be part of a stop string is held back."""
        ids = self.token_ids[self.num_prompt_tokens + self._streamed_tokens:]
        end = len(self.text)
        if not self.is_finished and self.detokenizer is not None:
            # A stop string may start up to `_stop_hold` characters before the settled end and run into the rest.
            end = max(self._streamed_chars, self.detokenizer.num_settled_chars - self._stop_hold)
        new_text = self.text[self._streamed_chars:end]
        if not ids and not new_text and not self.is_finished:
            return None
        self._streamed_tokens += len(ids)
        self._streamed_chars = max(self._streamed_chars, end)
        if self.is_finished:
            return StreamDelta(self.request_id, ids, new_text, True, self.finish_reason, self.output())
        return StreamDelta(self.request_id, ids, new_text)
