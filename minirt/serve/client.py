"""Chapter 08: the front end's side of the split - an `EngineClient` that the app uses as it uses an `Engine`.

The app calls the same names in both modes: `tokenizer`, `config`, `model.config`, `validate`, `submit` (a
request with `.future`, `.stream`, `.is_finished`, `.output()`, `.request_id`), `abort`, `stats`, `requests`,
`step_callbacks`, `async with`. Here they are served by a front end that keeps a `minirt.request.Request` per
request, as vLLM v1's `OutputProcessor` keeps its request states: the engine-core process (`core.py`) sends
token ids, and this side appends them with `Request.append_token`, the same code the engine runs in-process -
so the text, the stop strings and the held-back stream text are those of `LLM.generate`, token for token. A
stop string found here ends the request at once (its future resolves) and sends ABORT to the core, which may
have computed a token or two more: they are dropped.

`validate`, `encode` and `max_prompt_chars` ARE `Engine`'s, the same functions: they read `tokenizer`, `config`, `model.config.vocab_size`,
`pool.num_blocks` and `requests`, which the client mirrors from the core's settings, so every check the engine
makes on a request runs here, before anything is sent.

If the core process dies, its socket closes: every request in flight ends with finish_reason "error", `stats()`
reports the failure (GET /health answers 503) and `submit` raises `EngineFailedError` (503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from minirt.config import EngineConfig
from minirt.engine import Engine, EngineFailedError
from minirt.model.loader import load_config, load_tokenizer
from minirt.request import Request
from minirt.sampling import SamplingParams
from minirt.serve.core import ABORT, ADD, HELLO

logger = logging.getLogger("minirt.serve")


class StepOutputs(NamedTuple):
    """What the step callbacks get per OUTPUTS message: `items`, (request, new tokens taken) pairs, as an
    engine batch's `items` are (request, tokens scheduled) pairs."""

    items: list


class EngineClient:
    """A front end connected to an engine core at `address` (`core.start_engine_core`); `info` is the core's
    `describe`. Loads the tokenizer and the model's config (not its weights) from the checkpoint."""

    validate = Engine.validate          # the same checks in both modes (see the module's docstring)
    _tokenize = Engine._tokenize
    encode = Engine.encode
    max_prompt_chars = Engine.max_prompt_chars

    def __init__(self, address: str, info: dict):
        self.address, self.info = address, info
        path = info["checkpoint_path"]
        self.tokenizer = load_tokenizer(Path(path)) if info["has_tokenizer"] else None
        self.config = EngineConfig(**info["config"])
        self.model = SimpleNamespace(config=load_config(path), checkpoint_path=path, dtype=info["config"]["dtype"])
        self.device = info["config"]["device"]
        self.pool = SimpleNamespace(num_blocks=self.config.num_kv_blocks)
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.requests: dict[str, Request] = {}
        #: Called as `callback(client, StepOutputs)` after each OUTPUTS message (the metrics count tokens there).
        self.step_callbacks: list = []
        self._core_stats = dict(info["stats"])
        self._failure: str | None = None
        self._num_sent = self._num_acked = 0      # ADDs sent, and taken by the core (its waiting queue is behind)
        self._tasks: list[asyncio.Task] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "EngineClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def start(self) -> None:
        if self._tasks is not None:
            raise RuntimeError("engine client already started")
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
            self.socket.setsockopt(option, value)
        monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self.socket.connect(self.address)
        self._send([HELLO])
        self._tasks = [asyncio.create_task(self._read_outputs(), name="minirt-client-outputs"),
                       asyncio.create_task(self._watch(monitor), name="minirt-client-watch")]

    async def shutdown(self) -> None:
        """Stop listening to the core; requests still in flight end with finish_reason "abort" (the core is
        told to drop them)."""
        tasks, self._tasks = self._tasks, None
        for request_id in list(self.requests):
            self.abort(request_id, "engine shut down")
        for task in tasks or ():
            task.cancel()
        for task in tasks or ():
            try:
                await task
            except asyncio.CancelledError:
                pass
        if tasks is not None:
            self.socket.disable_monitor()
            self.context.destroy(linger=0)

    # ------------------------------------------------------------------ what the app calls
    def stats(self) -> dict:
        """The core's `Engine.stats()` as of its last message; `num_waiting` also counts the requests sent and
        not yet taken, `failed` the core's death."""
        s = dict(self._core_stats)
        s["num_waiting"] += self._num_sent - self._num_acked
        s["failed"] = self._failure or s["failed"]
        return s

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               stream: bool = False) -> Request:
        """Validate, send ADD to the core; returns the front end's Request (its `future` resolves to the
        RequestOutput). Raises ValueError for bad input, EngineFailedError once the core failed."""
        if self._tasks is None:
            raise RuntimeError("engine client is not running: use `async with client:`")
        failed = self.stats()["failed"]
        if failed:
            raise EngineFailedError(f"engine failed ({failed}); restart the server")
        text, ids, params = self.validate(prompt, params, request_id)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        request = Request(request_id, text, ids, params, self.eos_token_ids, self.tokenizer)
        request.future = asyncio.get_running_loop().create_future()
        if stream:
            request.stream = asyncio.Queue()
        self.requests[request_id] = request
        # stop strings stay here: the core sees token ids only
        self._send([ADD, request_id, ids, {**dataclasses.asdict(params), "stop": ()}])
        self._num_sent += 1
        return request

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Resolve the request with "abort" now and tell the core to free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, "abort", reason)
        self._send([ABORT, [request_id]])
        return True

    # ------------------------------------------------------------------ the core's messages
    def _send(self, message: list) -> None:
        # No high-water mark, so the send never waits: it is queued at once (the returned future is done).
        self.socket.send(msgpack.packb(message))

    async def _read_outputs(self) -> None:
        try:
            while True:
                _, outputs, stats, num_added = msgpack.unpackb(await self.socket.recv())
                self._core_stats, self._num_acked = stats, num_added
                now = time.perf_counter()
                items = []
                for request_id, new_token_ids, finish_reason, error, num_cached_tokens in outputs:
                    request = self.requests.get(request_id)
                    if request is None:          # ended here already: a stop string, an abort
                        continue
                    request.num_cached_tokens = num_cached_tokens
                    items.append((request, self._append(request, new_token_ids, now, finish_reason is None)))
                    if finish_reason is not None:
                        self._finish(request, finish_reason, error)
                for callback in self.step_callbacks:
                    callback(self, StepOutputs(items))
        except asyncio.CancelledError:
            raise
        except Exception as e:            # noqa: BLE001 - a broken message must not leave futures pending
            logger.exception("minirt front end: cannot read the engine core's outputs")
            self._fail(f"{type(e).__name__} reading the engine core's outputs: {e}")

    def _append(self, request: Request, token_ids: list[int], now: float, core_running: bool) -> int:
        """Append the core's new tokens as the engine does (stop checks and all); returns how many were taken."""
        for taken, token in enumerate(token_ids, 1):
            request.append_token(token, now)
            if request.finish_reason is not None:
                self._finish(request, request.finish_reason)
                if core_running:            # a stop string: the core does not know it, and would go on
                    self._send([ABORT, [request.request_id]])
                return taken
        if request.stream is not None:
            delta = request.stream_delta()
            if delta is not None:
                request.stream.put_nowait(delta)
        return len(token_ids)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.is_finished:
            return
        request.finish(reason, error)
        self.requests.pop(request.request_id, None)
        if request.future is not None and not request.future.done():
            request.future.set_result(request.output())
        if request.stream is not None:
            request.stream.put_nowait(request.stream_delta())

    async def _watch(self, monitor) -> None:
        """The core's socket closes when its process dies (or refuses the connection if it died before): fail
        what is in flight, and refuse what comes, instead of waiting forever."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._fail("the engine core process is gone (its connection closed)")
                elif event["event"] == zmq.EVENT_CONNECT_RETRIED and self._failure is None:
                    self._fail(f"the engine core process is gone (nothing listens at {self.address})")
        finally:
            monitor.close(linger=0)

    def _fail(self, message: str) -> None:
        logger.error("minirt front end: %s; resolving %d requests with an error", message, len(self.requests))
        self._failure = message
        for request in list(self.requests.values()):
            self._finish(request, "error", message)
