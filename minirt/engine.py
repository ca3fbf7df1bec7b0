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
import time
from typing import AsyncIterator

import torch

from minirt.attention import paged_attention_reference
from minirt.config import EngineConfig, cdiv
from minirt.cuda_graphs import DecodeGraphs
from minirt.kernels import pdl_missing, refuse_missing_triton, select_paged_attention
from minirt.kv.block_pool import BlockPool
from minirt.kv.paged_cache import allocate_kv_cache, kv_bytes_per_token
from minirt.kv.prefix_cache import PrefixCache
from minirt.model.layers import head_dim_of
from minirt.model.loader import load_model, resolve_device
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


def refuse_before_loading(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError naming the field for a switch asked for explicitly that cannot run on `device` or with the
    other settings, as far as that is known before the checkpoint is loaded (its head_dim is checked after).
    `Engine` calls it first, and `python -m minirt bench` too, so that a bad flag exits before anything runs."""
    c = config
    refuse_missing_triton(device, c.attention_backend, c.gemv, rotary_kernel=c.rotary_kernel, pdl=c.pdl,
                          kv_write_in_rotary=c.kv_write_in_rotary, combine_in_attention=c.combine_in_attention,
                          prefetch_kv=c.prefetch_kv, l2_prefetch=c.l2_prefetch)
    no_graphs = device.type != "cuda" or c.enforce_eager or c.attention_backend == "torch"
    where = f"device {device.type}, enforce_eager={c.enforce_eager}, attention_backend={c.attention_backend!r}"
    for name in ("norm_in_gemv", "l2_prefetch"):
        if getattr(c, name) and c.gemv is None and no_graphs:
            raise ValueError(f"{name}: needs the GEMV kernel, which is off without CUDA graphs ({where}); pass "
                             "gemv=True where it can run")
    if c.kv_write_in_rotary and c.rotary_kernel is None and no_graphs:
        raise ValueError(f"kv_write_in_rotary: needs the rotary kernel, which is off without CUDA graphs ({where}); "
                         "pass rotary_kernel=True where it can run")
    if c.prefetch_kv and c.pdl is None and no_graphs:
        raise ValueError(f"prefetch_kv: needs PDL, which is off without CUDA graphs ({where}); pass pdl=True where it "
                         "can run")


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
    """The asyncio inference engine. Same keyword arguments as `minirt.LLM`.

    Use it as an async context manager (`async with engine:` starts and stops the loop), then
    `await engine.generate(prompt, params)` or `async for delta in engine.stream(prompt, params)`.
    Raises ValueError (naming the field) for bad settings here and bad requests at submission.
    """

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, *, device=None, dtype=None,
                 block_size: int = 16, num_kv_blocks: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_prefill_chunk: int = 1024,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 attention_backend: str = "auto", split_kv: bool = True, enforce_eager: bool = False,
                 fused_ops: bool | None = None, merge_projections: bool | None = None, gemv: bool | None = None,
                 num_scheduler_steps: int | None = None, norm_in_gemv: bool | None = None,
                 rotary_kernel: bool | None = None, pdl: bool | None = None,
                 kv_write_in_rotary: bool | None = None, combine_in_attention: bool = False,
                 prefetch_kv: bool | None = None, l2_prefetch: bool | None = None):
        self.config = EngineConfig(block_size, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
                                   max_prefill_chunk, max_model_len, enable_prefix_caching, attention_backend,
                                   split_kv, enforce_eager, fused_ops, merge_projections, gemv, num_scheduler_steps,
                                   norm_in_gemv, rotary_kernel, pdl, kv_write_in_rotary, combine_in_attention,
                                   prefetch_kv, l2_prefetch)
        device = resolve_device(device)
        refuse_before_loading(self.config, device)     # before the checkpoint takes any memory
        self.model, self.tokenizer = load_model(model, device=device, dtype=dtype)
        self.device = self.model.device
        mc = self.model.config
        limit = getattr(mc, "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = limit or 2048
        elif limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings = {limit}")
        self.config.max_model_len = max_model_len
        if num_kv_blocks is None:
            num_kv_blocks = default_num_kv_blocks(mc, self.model.dtype, self.device, block_size, max_model_len,
                                                  max_num_seqs)
            self.config.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        kernel, store = select_paged_attention(attention_backend, self.device, head_dim_of(mc), split_kv)
        triton_attention = kernel is not paged_attention_reference
        use_graphs = not enforce_eager and self.device.type == "cuda" and triton_attention
        use_gemv = use_graphs if gemv is None else gemv         # None: where graphs hide its launch cost
        use_pdl = (use_graphs and not pdl_missing(self.device)) if pdl is None else pdl
        if prefetch_kv is None:
            prefetch_kv = bool(use_pdl and triton_attention and split_kv)
        elif prefetch_kv and not (use_pdl and triton_attention):
            raise ValueError("prefetch_kv: needs pdl and the Triton attention kernel, which resolved to "
                             f"{bool(use_pdl)} and {triton_attention} (device {self.device.type})")
        if triton_attention:
            kernel = functools.partial(kernel, prefetch_kv=prefetch_kv)
            if use_pdl:
                kernel, store = functools.partial(kernel, pdl=True), functools.partial(store, pdl=True)
        if combine_in_attention and not (triton_attention and split_kv):
            raise ValueError("combine_in_attention: needs the Triton attention kernel with split_kv, which did not "
                             f"resolve on (device {self.device.type})")
        if combine_in_attention:
            from minirt.kernels.paged_attention_triton import split_counters_for

            counters = split_counters_for(max_num_seqs, mc.num_key_value_heads, self.device)
            kernel = functools.partial(kernel, split_counters=counters)
        # With CUDA graphs, one more block than the pool hands out: the scratch block padding rows write to.
        kv_cache = allocate_kv_cache(mc, num_kv_blocks + use_graphs, block_size, self.model.dtype, self.device)
        on_cuda = self.device.type == "cuda"                 # None: the switch is on where it pays, on CUDA
        self.model.set_fused_ops(on_cuda if fused_ops is None else fused_ops)
        merged = bool(merge_projections or (merge_projections is None and on_cuda))
        if merged:
            self.model.merge_projections()
        if use_gemv:
            from minirt.kernels.gemv_triton import linear_gemv

            self.model.set_gemv(functools.partial(linear_gemv, pdl=True) if use_pdl else linear_gemv)
        if norm_in_gemv is None:
            norm_in_gemv = use_gemv and merged
        elif norm_in_gemv and not (use_gemv and merged):
            raise ValueError(f"norm_in_gemv: needs gemv and merge_projections, which resolved to {use_gemv} and {merged}")
        self.model.set_norm_in_gemv(norm_in_gemv)
        if l2_prefetch is None:
            l2_prefetch = bool(use_gemv and merged and use_pdl)
        elif l2_prefetch and not (use_gemv and merged):
            raise ValueError(f"l2_prefetch: needs gemv and merge_projections, which resolved to {use_gemv} and {merged}")
        if l2_prefetch:
            from minirt.kernels.gemv_triton import l2_prefetch_table

            self.model.prefetch_next_weights(l2_prefetch_table)
        #: Whether each one-row GEMV asks L2 for the next one's weights (`EngineConfig.l2_prefetch`, resolved).
        self.l2_prefetch = l2_prefetch
        use_rotary = use_graphs if rotary_kernel is None else rotary_kernel
        if use_rotary:
            from minirt.kernels.rotary_triton import norm_and_rotate_triton, norm_rotate_and_store_triton

            refuse_missing_triton(self.device, attention_backend, gemv, head_dim_of(mc), rotary_kernel=True)
            self.model.set_rotary_kernel(functools.partial(norm_and_rotate_triton, pdl=use_pdl))
        if kv_write_in_rotary is None:
            kv_write_in_rotary = use_rotary
        elif kv_write_in_rotary and not use_rotary:
            raise ValueError("kv_write_in_rotary: needs the rotary kernel, which resolved off (rotary_kernel=None is "
                             f"on with CUDA graphs only; device {self.device.type}, enforce_eager={enforce_eager})")
        if kv_write_in_rotary:
            self.model.set_rotary_store(functools.partial(norm_rotate_and_store_triton, pdl=use_pdl))
        #: Whether the Triton kernels launch with programmatic dependent launch (`EngineConfig.pdl`, resolved).
        self.pdl = bool(use_pdl)
        graphs = None
        if use_graphs:
            graphs = DecodeGraphs(self.model, kv_cache, kernel, max_num_seqs, cdiv(max_model_len, block_size),
                                  scratch_block=num_kv_blocks, store=store)
        self.model_runner = ModelRunner(self.model, kv_cache, block_size, kernel, graphs, store)
        #: Decode steps per schedule when all admitted requests decode (`EngineConfig.num_scheduler_steps`).
        self.num_scheduler_steps = (8 if use_graphs else 1) if num_scheduler_steps is None else num_scheduler_steps
        self.pool = BlockPool(num_kv_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.pool, self.prefix_cache)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._failure: str | None = None
        self.num_steps = 0        # forward steps: each decode step of a multi-step burst counts one
        #: Called as `callback(engine, batch)` after each step's bookkeeping, before the loop yields:
        #: the place to record timelines or check invariants (chapters 05-06, the load tests).
        self.step_callbacks: list = []

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
        """Pool and queue sizes right now, plus prefix-cache counters (tokens). `num_steps` counts forward
        steps: an engine step that runs a multi-step burst of k decode steps adds k."""
        return {
            "num_total_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": len(self.pool.cached),
            "num_waiting": len(self.waiting_queue),
            "num_prefilling": len(self.prefilling_requests),
            "num_running": len(self.running_requests),
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
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
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer; pass token ids (a list of int)")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
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

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               stream: bool = False) -> Request:
        """Validate and enqueue; returns the Request, whose `future` resolves to its RequestOutput.

        Raises ValueError for bad input, EngineFailedError after a failure, RuntimeError if not started.
        """
        if self._loop_task is None:
            raise RuntimeError("engine is not running: use `async with engine:` (or `await engine.start()`)")
        if self._failure is not None:
            raise EngineFailedError(f"engine failed ({self._failure}); restart it before submitting")
        text, ids, params = self.validate(prompt, params, request_id)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        request = Request(request_id, text, ids, params, self.eos_token_ids, self.tokenizer, self.device)
        request.future = asyncio.get_running_loop().create_future()
        if stream:
            request.stream = asyncio.Queue()
        self.requests[request_id] = request
        self.scheduler.add(request)
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
                    if not self.step():      # validated requests always fit: no progress is a bug, never a wait
                        raise RuntimeError("the scheduler could not schedule any of the requests it holds")
                except Exception as e:       # noqa: BLE001 - any failure must resolve every future
                    self._fail_all(e)
                await asyncio.sleep(0)
        except Exception as e:               # noqa: BLE001 - the loop itself broke, outside a step:
            self._fail_all(e)                # resolve everyone; the loop ends, submissions are refused

    def step(self) -> bool:
        """One engine step: schedule, run the model, postprocess. Returns False if nothing was scheduled.

        When every admitted request is decoding, one step may run several decode steps back to back
        (`num_scheduler_steps`, chapter 07); their tokens are then taken in order, as if from single steps.
        """
        num_steps = self.scheduler.decode_steps_ahead(self.num_scheduler_steps)
        batch = self.scheduler.schedule()
        if not batch:
            return False
        now = time.perf_counter()
        for request, _ in batch.items:
            if request.scheduled_time is None:
                request.scheduled_time = now
        if num_steps > 1:
            sampled_requests, token_steps = self.model_runner.execute_decode_steps(batch.items, num_steps)
        else:
            sampled_requests, tokens = self.model_runner.execute(batch.items)
            token_steps = [tokens]
        self.num_steps += num_steps
        now = time.perf_counter()
        for tokens in token_steps:
            for request, n in batch.items:
                if not request.is_finished:              # a request that stopped part-way drops its later tokens
                    self.scheduler.update_after_step(request, n)
            for request, token in zip(sampled_requests, tokens):
                if request.is_finished:
                    continue
                request.append_token(token, now)
                if request.finish_reason is not None:
                    self._finish(request, request.finish_reason)
                elif request.stream is not None:
                    delta = request.stream_delta()
                    if delta is not None:
                        request.stream.put_nowait(delta)
        for callback in self.step_callbacks:
            callback(self, batch)
        return True

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
