"""Chapter 05: the asyncio engine - one thread, one event loop, three collections, continuous batching.

Callers `await engine.generate(...)` (or iterate `engine.stream(...)`); each call submits a `Request`
whose future the engine resolves. A single background task runs the loop:

    while there is work:
        batch = scheduler.schedule()              # admit -> prefill chunks -> decodes, within the budget
        requests, tokens = model_runner.execute(batch)
        postprocess: append tokens, stop checks, free blocks, resolve futures
        await asyncio.sleep(0)                    # let callers submit, time out, read streams

New requests join the running batch at the next step instead of waiting for the batch to drain
(continuous batching; Yu et al. 2022, "Orca", section 3). Everything happens on one thread, so no
locks: a timeout or a cancellation runs between two steps and simply removes the request.

Failure rules: bad input raises `ValueError` at submission and disturbs nothing; a timeout raises
`TimeoutError` in that caller only and frees the request's blocks; an exception in a step (a device
out-of-memory error above all) resolves *every* request with `finish_reason="error"` instead of
leaving futures pending, and later submissions are refused until the engine is restarted.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import re
import time
from typing import AsyncIterator

import torch

from minirt.config import EngineConfig, takes_settings
from minirt.kv.block_pool import BlockPool
from minirt.kv.paged_cache import allocate_kv_cache, kv_bytes_per_token
from minirt.kv.prefix_cache import PrefixCache
from minirt.model.loader import load_config, load_model, resolve_checkpoint
from minirt.model_runner import ModelRunner
from minirt.request import Request, RequestOutput, StreamDelta
from minirt.sampling import SamplingParams
from minirt.scheduler import Scheduler, blocks_needed

logger = logging.getLogger(__name__)

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "default_model")

#: Default KV pool on the CPU: at most this many bytes and tokens. On a GPU the pool takes this
#: fraction of the memory left free after loading the model.
CPU_KV_CACHE_BYTES = 256 * 2**20
CPU_KV_CACHE_TOKENS = 65536
GPU_MEMORY_UTILIZATION = 0.85

_SURROGATE = re.compile("[\ud800-\udfff]")     # a lone UTF-16 half: Python strings may hold one, UTF-8 cannot


class EngineFailedError(RuntimeError):
    """The engine hit an error in a step (for example device out-of-memory) and must be restarted."""


def default_num_kv_blocks(config, dtype: torch.dtype, device: torch.device, block_size: int,
                          max_model_len: int, max_num_seqs: int) -> int:
    """Size the pool from memory: a fixed budget on the CPU, a share of free memory on a GPU.

    Never more than every seat at full length needs (`max_num_seqs * max_model_len` tokens), never
    fewer blocks than one request of `max_model_len` tokens needs.
    """
    per_token = kv_bytes_per_token(config, dtype)
    if per_token == 0:                                   # no layers, no K/V: any pool will do
        return blocks_needed(max_model_len, 0, block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * GPU_MEMORY_UTILIZATION) // per_token
    else:
        tokens = min(CPU_KV_CACHE_BYTES // per_token, CPU_KV_CACHE_TOKENS)
    tokens = min(tokens, max_num_seqs * max_model_len)
    return max(tokens // block_size, blocks_needed(max_model_len, 0, block_size))


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids as `transformers.generate` takes them: the generation config's, else the model config's."""
    ids = None
    path = getattr(model, "checkpoint_path", None)
    if path and os.path.exists(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig

        ids = GenerationConfig.from_pretrained(path).eos_token_id
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


class Engine:
    """The asyncio inference engine. `model`: a checkpoint directory or hub id; `settings`: the fields of
    `minirt.config.EngineConfig` (the same keyword arguments as `minirt.LLM`).

    Use it as an async context manager (`async with engine:` starts and stops the loop), then
    `await engine.generate(prompt, params)` or `async for delta in engine.stream(prompt, params)`.
    Raises ValueError (naming the field) for bad settings here and bad requests at submission. A text prompt is
    tokenized with the tokenizer's defaults, `tokenizer(text)` (a BOS if it adds one), as vLLM does.

    This is chapter 05's engine: chapter 05's `ModelRunner` (`build_model_runner`), chapter 06's `Scheduler`
    (`build_scheduler`), one decode step per engine step (`choose_step` returns `step`), one process. It reads no
    speed switch of chapter 07 and no `tensor_parallel_size` of chapter 09: they are accepted (the settings are
    declared once, in `EngineConfig`) and ignored. `minirt.Engine` and `minirt.LLM` build the full engine, which
    honours them: chapter 07's `minirt.fast.FastEngine`, a subclass that overrides these three builders (for
    multi-step decode its scheduler also grants bursts), or chapter 09's `minirt.parallel.engine.TensorParallelEngine`.
    """

    @takes_settings
    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, **settings):
        self.config = config = EngineConfig.from_settings(settings)
        path = resolve_checkpoint(model)
        model_config = load_config(path)
        limit = getattr(model_config, "max_position_embeddings", None)
        if config.max_model_len is None:
            config.max_model_len = limit or 2048
        elif limit is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings = {limit}")
        self.model, self.tokenizer = self.load_model(path)
        self.device = self.model.device
        if config.num_kv_blocks is None:
            config.num_kv_blocks = default_num_kv_blocks(model_config, self.model.dtype, self.device,
                                                         config.block_size, config.max_model_len, config.max_num_seqs)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.model_runner = self.build_model_runner()
        self.pool = BlockPool(config.num_kv_blocks)
        self.prefix_cache = PrefixCache(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = self.build_scheduler()
        #: The step the loop runs, chosen once (vLLM v1's `step_fn`); `step` itself is never replaced.
        self.step_fn = self.choose_step()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._failure: str | None = None
        self.num_steps = 0        # forward steps
        #: Called as `callback(engine, batch)` after each step's bookkeeping, before the loop yields:
        #: the place to record timelines or check invariants (chapters 05-06, the load tests).
        self.step_callbacks: list = []

    def build_model_runner(self) -> ModelRunner:
        """The model runner over the loaded model, with a KV cache of `config.num_kv_blocks` blocks."""
        cfg = self.config
        kv_cache = allocate_kv_cache(self.model.config, cfg.num_kv_blocks, cfg.block_size, self.model.dtype,
                                     self.device)
        return ModelRunner(self.model, kv_cache, cfg.block_size)

    def build_scheduler(self) -> Scheduler:
        """The scheduler over the block pool and prefix cache (chapters 05-06)."""
        return Scheduler(self.config, self.pool, self.prefix_cache)

    def choose_step(self):
        """The function the loop calls for each engine step (returns False if nothing was scheduled): `step`."""
        return self.step

    # ------------------------------------------------------------------ collections (read-only views)
    @property
    def waiting_queue(self):
        return self.scheduler.waiting_queue

    @property
    def prefilling_requests(self):
        return self.scheduler.prefilling_requests

    @property
    def running_requests(self):
        return self.scheduler.running_requests

    def stats(self) -> dict:
        """Pool and queue sizes right now, plus prefix-cache counters (tokens) and `num_steps`, the forward
        steps run so far."""
        return {
            "num_total_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": len(self.pool.cached),
            "num_waiting": len(self.waiting_queue),
            "num_prefilling": len(self.prefilling_requests),
            "num_running": len(self.running_requests),
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_preempted_recomputed_tokens": self.scheduler.num_preempted_recomputed_tokens,
            "prefix_cache_queries": self.prefix_cache.queries,
            "prefix_cache_hits": self.prefix_cache.hits,
            "failed": self._failure,
        }

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Start the loop task on the running event loop (a failed engine is reset and serves again)."""
        if self._loop_task is not None:
            raise RuntimeError("engine already started")
        self._failure = None
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run_loop(), name="minirt-engine-loop")

    async def shutdown(self) -> None:
        """Stop the loop; requests still in flight are resolved with finish_reason "abort"."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for request in list(self.requests.values()):
            self._finish(request, "abort", "engine shut down")

    # ------------------------------------------------------------------ submission
    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The longest text that can fit in `max_model_len` tokens: no token decodes to more characters than its
        vocabulary entry has (byte-level BPE: one per byte; SentencePiece: one per character), so longer text is
        refused before the tokenizer runs, which on megabytes of text takes seconds."""
        return self.config.max_model_len * max(map(len, self.tokenizer.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """`text` as token ids (`add_special_tokens`: a BOS if the tokenizer adds one). Raises ValueError naming
        `field` for text longer than `max_prompt_chars` (checked first), text that is not valid Unicode (an
        unpaired surrogate: no UTF-8 form) and anything else the tokenizer cannot take."""
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"{field}: {len(text)} characters cannot fit in max_model_len = "
                             f"{self.config.max_model_len} tokens (at most {self.max_prompt_chars} characters)")
        if not text.isascii() and (bad := _SURROGATE.search(text)):
            raise ValueError(f"{field}: is not valid Unicode text: unpaired surrogate {bad.group()!r} at index "
                             f"{bad.start()}")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)
        except Exception as e:               # noqa: BLE001 - whatever the tokenizer refuses is a bad request
            raise ValueError(f"{field}: the tokenizer cannot encode it ({type(e).__name__}: {str(e)[:200]})") from None

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer; pass token ids (a list of int)")
            return prompt, self.encode(prompt)      # the tokenizer's defaults: a BOS if it adds one
        if isinstance(prompt, (list, tuple)):
            kinds = set(map(type, prompt))            # ints, and no bool (a subclass of int): checked per type
            if bool not in kinds and all(issubclass(kind, int) for kind in kinds):
                return None, list(prompt)
        raise ValueError(f"prompt: must be a str or a list of int token ids, got {type(prompt).__name__}")

    def validate(self, prompt, params: SamplingParams | None, request_id: str | None = None
                 ) -> tuple[str | None, list[int], SamplingParams]:
        """Check one request against every limit; raises ValueError naming the field. Changes nothing."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a minirt.SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt: is empty (needs at least one token)")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"prompt: token id {ids[bad]} at index {bad} is outside the vocabulary [0, {vocab})")
        cfg = self.config
        total = len(ids) + params.max_new_tokens
        if total > cfg.max_model_len:
            raise ValueError(f"prompt + max_new_tokens: {len(ids)} + {params.max_new_tokens} = {total} tokens "
                             f"exceeds max_model_len = {cfg.max_model_len}")
        need = blocks_needed(len(ids), params.max_new_tokens, cfg.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"prompt + max_new_tokens: {total} tokens need {need} KV blocks of {cfg.block_size}, "
                             f"more than the whole pool (num_kv_blocks = {self.pool.num_blocks})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this checkpoint has none")
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
            if request_id in self.requests:
                raise ValueError(f"request_id: {request_id!r} is already in flight (duplicate request id)")
        return text, ids, params

    def _add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Validate and enqueue a request for the next steps; returns it. Raises ValueError for bad input.
        What `submit` and `minirt.LLM` (which drives `step_fn` itself) share."""
        return self._enqueue(*self.validate(prompt, params, request_id), request_id)

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams, request_id: str | None = None
                 ) -> Request:
        """Enqueue a request `validate` has accepted (its `(text, ids, params)`); returns it."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        request = Request(request_id, text, ids, params, self.eos_token_ids, self.tokenizer, self.device)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               stream: bool = False) -> Request:
        """Validate and enqueue; returns the Request, whose `future` resolves to its RequestOutput.

        Raises ValueError for bad input, EngineFailedError after a failure, RuntimeError if not started.
        """
        if self._loop_task is None:
            raise RuntimeError("engine is not running: use `async with engine:` (or `await engine.start()`)")
        if self._failure is not None:
            raise EngineFailedError(f"engine failed ({self._failure}); restart it before submitting")
        future = asyncio.get_running_loop().create_future()
        request = self._add_request(prompt, params, request_id)
        request.future = future
        if stream:
            request.stream = asyncio.Queue()
        self._wakeup.set()
        return request

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       timeout: float | None = None) -> RequestOutput:
        """Submit one request and wait for its output. `timeout` in seconds: on expiry the request is
        removed (blocks freed) and TimeoutError is raised here only."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds or None, got {timeout!r}")
        request = self.submit(prompt, params, request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(request.future), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.abort(request.request_id, "timed out")
            raise TimeoutError(f"request {request.request_id!r} timed out after {timeout} s") from None
        except asyncio.CancelledError:
            self.abort(request.request_id, "cancelled")
            raise

    async def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     timeout: float | None = None) -> AsyncIterator[StreamDelta]:
        """Submit one request and yield its new tokens and text as they come; the last delta has
        `finished=True`. Text that may still become a stop string is held back until settled."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds or None, got {timeout!r}")
        request = self.submit(prompt, params, request_id, stream=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    delta = await asyncio.wait_for(request.stream.get(), left)
                except (asyncio.TimeoutError, TimeoutError):
                    raise TimeoutError(f"request {request.request_id!r} timed out after {timeout} s") from None
                yield delta
                if delta.finished:
                    return
        finally:
            if not request.is_finished:
                self.abort(request.request_id, "stream closed")

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Remove a request from every collection, free its blocks, resolve it with "abort"."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, "abort", reason)
        return True

    # ------------------------------------------------------------------ the loop
    async def _run_loop(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    if not self.step_fn():   # validated requests always fit: no progress is a bug, never a wait
                        raise RuntimeError("the scheduler could not schedule any of the requests it holds")
                except Exception as e:       # noqa: BLE001 - any failure must resolve every future
                    self._fail_all(e)
                await asyncio.sleep(0)
        except Exception as e:               # noqa: BLE001 - the loop itself broke, outside a step:
            self._fail_all(e)                # resolve everyone; the loop ends, submissions are refused

    def step(self) -> bool:
        """One engine step: schedule, run the model, postprocess. Returns False if nothing was scheduled."""
        batch = self.scheduler.schedule()
        if not batch:
            return False
        self.start_step(batch)
        requests, tokens = self.model_runner.execute(batch.items)
        self.postprocess(batch, requests, tokens, time.perf_counter())
        self.end_step(batch)
        return True

    def start_step(self, batch) -> None:
        now = time.perf_counter()
        for request, _ in batch.items:
            if request.scheduled_time is None:
                request.scheduled_time = now

    def postprocess(self, batch, requests: list[Request], tokens: list[int], now: float) -> None:
        """Account for the batch's computed tokens, append each sampled token (`requests[i]` got `tokens[i]`),
        finish the requests that stop, stream the others' new text."""
        for request, n in batch.items:
            if not request.is_finished:
                self.scheduler.update_after_step(request, n)
        for request, token in zip(requests, tokens):
            if request.is_finished:
                continue
            request.append_token(token, now)
            if request.finish_reason is not None:
                self._finish(request, request.finish_reason)
            elif request.stream is not None:
                delta = request.stream_delta()
                if delta is not None:
                    request.stream.put_nowait(delta)

    def end_step(self, batch) -> None:
        self.num_steps += 1
        for callback in self.step_callbacks:
            callback(self, batch)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.is_finished:
            return
        self.scheduler.remove(request)
        request.finish(reason, error)
        self.requests.pop(request.request_id, None)
        output = request.output()
        if request.future is not None and not request.future.done():
            request.future.set_result(output)
        if request.stream is not None:
            request.stream.put_nowait(request.stream_delta())

    def _fail_all(self, exc: BaseException) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            message = f"device out of memory during a step: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
        else:
            message = f"{type(exc).__name__} during a step: {exc}"
        logger.error("minirt engine failed, resolving %d requests with an error: %s", len(self.requests), message)
        self._failure = message
        for request in list(self.requests.values()):
            try:
                self._finish(request, "error", message)
            except Exception:                # noqa: BLE001 - the bookkeeping is broken too: resolve the caller anyway
                self.requests.pop(request.request_id, None)
                request.finish("error", message)
                if request.future is not None and not request.future.done():
                    request.future.set_result(request.output())

    async def restart(self) -> None:
        """Stop and start again: after a failure, the engine serves new requests (the pool is all free)."""
        await self.shutdown()
        await self.start()

    def load_model(self, path) -> tuple:
        """`(model, tokenizer)` of the checkpoint at `path`, in `config.device` and `config.dtype`: chapter 00's
        `minirt.load_model`. The one builder of the model, so a subclass may load it otherwise (`FastEngine`:
        quantized)."""
        return load_model(path, device=self.config.device, dtype=self.config.dtype)
