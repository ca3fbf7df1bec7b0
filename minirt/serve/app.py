"""Chapter 08: the HTTP front end - FastAPI routes over the asyncio `Engine`, in the same event loop, or over
an `EngineClient` whose engine core runs in another process (`minirt.serve.core`, `minirt.serve.client`).

    POST /v1/completions, POST /v1/chat/completions   OpenAI's shapes; "stream": true answers with SSE
    GET /v1/models, GET /health, GET /metrics         the served model, liveness, Prometheus text

A request's life over HTTP: the body is parsed and checked (400 naming the field), admitted or refused
(429 when the waiting queue is full, 503 while draining), then submitted to the engine with
`engine.submit` - in the handler, so admission and enqueueing happen with no `await` between them. What
chapter 05's caller awaited as a future becomes either one JSON answer (the future's result) or a stream
of server-sent events, one per engine `StreamDelta` (`protocol.delta_chunks`), ending with `data: [DONE]`.
A client that goes away aborts its request: the engine frees its blocks at once (vLLM's
`with_cancellation` for plain answers; sse-starlette's disconnect listener for streams).

The routes are the same in both modes: `build_app(engine)` takes either, since the client answers the
names the app uses (validate, submit, abort, stats, requests, step_callbacks, tokenizer, config).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.background import BackgroundTask

from minirt.engine import EngineFailedError
from minirt.sampling import SamplingParams
from minirt.serve.metrics import ServerMetrics
from minirt.serve.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, api_error,
                                   completion_response, delta_chunks, error_body, prompt_of, refuse_unsupported,
                                   sampling_params, short)

logger = logging.getLogger("minirt.serve")

#: Seconds a refused client is told to wait (the `Retry-After` header of 429 and 503 answers).
RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """What the routes share: the engine, the served model's names, the admission bound, the metrics."""

    engine: object
    model_name: str
    model_path: str
    max_waiting: int
    metrics: ServerMetrics
    draining: bool = False          # set at shutdown: new requests get 503, in-flight ones finish
    created: int = field(default_factory=lambda: int(time.time()))


ARRIVAL = "minirt.arrival_time"


class StampArrival:
    """ASGI middleware: `scope[ARRIVAL]` = `time.perf_counter()` when the request reaches the front end, before
    its body is read, parsed and tokenized; the request's TTFT and latency are measured from there."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


def admission(num_waiting: int, max_waiting: int, draining: bool) -> tuple[int, str] | None:
    """None to admit a request, else (HTTP status, reason) to refuse it: 503 while the server drains for
    shutdown, 429 when `num_waiting` requests already wait and the queue holds at most `max_waiting`.
    The bound keeps memory bounded under overload: the engine holds at most max_num_seqs requests admitted
    plus `max_waiting` waiting; the rest are told to come back (TGI's `--max-concurrent-requests`)."""
    if draining:
        return 503, "server is shutting down"
    if num_waiting >= max_waiting:
        return 429, f"server is overloaded: {num_waiting} requests wait (max_waiting = {max_waiting}); retry later"
    return None


def error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, type, code), status_code=status, headers=headers)


def validation_message(err: dict) -> tuple[str | None, str]:
    """(param, message) of pydantic's first error: "max_tokens: must be >= 1, got 0". The param is the field's
    path ("messages.0.role"), or "body" when the body as a whole is wrong; the input is echoed cut (`short`)."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # a union's branch shows up as a type name ("stop", "str"): the field is what comes before it
    tags = next((i for i, x in enumerate(loc) if "[" in x or x in ("str", "int", "float", "bool")), len(loc))
    loc = loc[:tags]
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind == "json_invalid":
        return "body", f"body: malformed JSON ({ctx.get('error', err.get('msg'))})"
    param = ".".join(loc) or "body"
    limits = {"greater_than_equal": ">= {ge}", "greater_than": "> {gt}", "less_than_equal": "<= {le}",
              "less_than": "< {lt}"}
    if kind in limits:
        reason = "must be " + limits[kind].format(**ctx)
    elif kind == "missing":
        return param, f"{param}: is required"
    elif kind == "extra_forbidden":
        param = param if len(param) <= 100 else param[:100] + "..."
        return param, f"{param}: not a field minirt's server knows (unknown fields are refused, not ignored)"
    else:
        reason = err.get("msg", "is invalid").lower()
    return param, f"{param}: {reason}, got {short(err.get('input'))}"


#: OpenAI's error `type` of an HTTP status without a more precise one.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def http_error(request: Request, status: int, detail, headers: dict | None = None) -> JSONResponse:
    """An HTTP error outside the routes' own checks (unknown route, wrong method, 413, ...) in OpenAI's shape."""
    if status == 404 and detail in (None, "Not Found"):
        message = f"{request.method} {short(request.url.path)}: no such route"
    elif status == 405:
        allowed = {k.lower(): v for k, v in (headers or {}).items()}.get("allow")
        message = f"{request.method} {short(request.url.path)}: method not allowed (allowed: {allowed})"
    else:
        message = str(detail) if detail else f"HTTP {status}"
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return error_response(status, message, type=kind, headers=headers)


async def _disconnected(raw: Request) -> None:
    """Return when the client goes away (the body has been read already, so only http.disconnect is left)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def build_app(engine, model_name: str | None = None, model_path: str | None = None, max_waiting: int = 256) -> FastAPI:
    """The FastAPI app serving `engine` (not started: the app's lifespan starts and stops it, on the server's
    event loop). `model_name`: the id clients pass as "model" (default: the checkpoint folder's name);
    `max_waiting`: the waiting-queue bound past which requests get 429."""
    if not isinstance(max_waiting, int) or max_waiting < 1:
        raise ValueError(f"max_waiting: must be an integer >= 1, got {max_waiting!r}")
    path = str(model_path or getattr(engine.model, "checkpoint_path", "") or "")
    name = model_name or os.path.basename(os.path.normpath(path)) or "minirt"
    state = ServerState(engine, name, path, max_waiting, ServerMetrics(engine))
    # sse-starlette ends every open stream the moment the server is asked to stop; minirt drains instead
    # (`minirt.serve.server.Server`): in-flight streams finish, or end with finish_reason "abort".
    AppStatus.disable_automatic_graceful_drain()

    @asynccontextmanager
    async def lifespan(app):
        engine.step_callbacks.append(state.metrics.count_step)     # token counters advance per engine step
        try:
            async with engine:
                yield
        finally:
            engine.step_callbacks.remove(state.metrics.count_step)

    app = FastAPI(title="minirt", lifespan=lifespan)
    app.state.minirt = state
    app.add_middleware(StampArrival)

    # Every error leaves in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, never FastAPI's
    # {"detail": ...}: body parse and validation errors (400), unknown routes (404), methods (405), 413, and
    # exceptions nobody caught (500, logged with their traceback).
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc: RequestValidationError):
        param, message = validation_message(exc.errors()[0])
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request, exc: RequestError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        return http_error(request, exc.status_code, exc.detail, exc.headers)

    @app.exception_handler(Exception)
    async def on_internal_error(request, exc: Exception):
        return error_response(500, f"internal server error ({type(exc).__name__})", type="server_error")

    @app.get("/health")
    async def health():
        failed = engine.stats()["failed"]
        if failed or state.draining:
            return JSONResponse({"status": "failed" if failed else "draining", "reason": failed}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "minirt", "root": path,
                "max_model_len": engine.config.max_model_len, "vocab_size": engine.model.config.vocab_size}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        refuse_unsupported(body)
        return await _serve(state, raw, body, prompt_of(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        refuse_unsupported(body)
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError("messages", "messages: this model has no chat template; use /v1/completions")
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        chars = sum(len(m["content"]) for m in messages)
        if chars > engine.max_prompt_chars:      # refused before the template and the tokenizer run on megabytes
            raise RequestError("messages", f"messages: {chars} characters of content cannot fit in max_model_len = "
                                           f"{engine.config.max_model_len} tokens (at most {engine.max_prompt_chars})")
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:      # noqa: BLE001 - a template may refuse a conversation (roles out of order, ...)
            raise RequestError("messages", f"messages: the model's chat template refused them ({short(str(e), 300)})"
                               ) from None
        # The template writes its own special tokens (a BOS): encoded without adding them again, as vLLM does.
        try:
            ids = engine.encode(prompt, add_special_tokens=False, field="messages")
        except ValueError as e:
            raise RequestError("messages", str(e)) from None
        return await _serve(state, raw, body, ids, chat=True)

    return app


async def _serve(state: ServerState, raw: Request, body, prompt, chat: bool):
    """Validate, admit, submit; answer with JSON or with an SSE stream."""
    engine = state.engine
    if body.model is not None and body.model not in (state.model_name, state.model_path):
        return error_response(404, f"model: {body.model!r} does not exist; this server serves {state.model_name!r}",
                              "model", code="model_not_found")
    try:
        max_tokens = body.requested_max_tokens
        if max_tokens is None and chat:      # the room the context leaves (completions: OpenAI's 16)
            _, prompt, _ = engine.validate(prompt, SamplingParams(max_new_tokens=1))   # the ids, from here on
            max_tokens = max(1, engine.config.max_model_len - len(prompt))
        params = sampling_params(body, max_tokens or 16)
        _, ids, params = engine.validate(prompt, params)              # tokenized once, checked against every limit
    except ValueError as e:
        raise api_error(e) from None
    refused = admission(engine.stats()["num_waiting"], state.max_waiting, state.draining)
    if refused is not None:
        status, message = refused
        state.metrics.rejected.labels("draining" if status == 503 else "queue_full").inc()
        return error_response(status, message, type="server_error" if status == 503 else "rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        request = engine.submit(ids, params, request_id=request_id, stream=body.stream)
    except EngineFailedError as e:
        return error_response(503, str(e), type="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    request.arrival_time = raw.scope.get(ARRIVAL, request.arrival_time)   # TTFT counts the wait before the engine
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        observed: list = []          # _events records the finished request here; the background task if not

        async def on_disconnect(message):
            # Abort here, not when sse-starlette cancels the response: while the engine keeps this stream's
            # queue fed, anyio's cancellation may find the task between two deltas only when the request ends.
            _abort_unfinished(engine, request, "client disconnected")

        return EventSourceResponse(_events(state, request, head, chat, include_usage, observed), sep="\n",
                                   client_close_handler_callable=on_disconnect,
                                   background=BackgroundTask(_close_stream, state, request, observed))
    waiter = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait([request.future, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:                          # the client went away, or this handler was cancelled: free the blocks
        waiter.cancel()
        _abort_unfinished(engine, request, "client disconnected")
    output = request.future.result()
    state.metrics.observe(output)
    if output.error == "client disconnected":
        return Response(status_code=499)          # nobody is listening (nginx's "client closed request")
    if output.finish_reason == "error":
        return error_response(500, output.error or "engine error", type="server_error")
    return JSONResponse(completion_response(output, head, chat))


def _abort_unfinished(engine, request, reason: str = "stream closed") -> None:
    if not request.is_finished:
        engine.abort(request.request_id, reason)


async def _close_stream(state: ServerState, request, observed: list) -> None:
    """After a streamed response, however it ended: a request still running lost its client; abort it.
    (A coroutine, so that it runs on the event loop: Starlette runs a plain function on a worker thread.)"""
    _abort_unfinished(state.engine, request, "client disconnected")
    if not observed:
        state.metrics.observe(request.output())


async def _events(state: ServerState, request, head: dict, chat: bool, include_usage: bool, observed: list):
    """The SSE `data:` payloads of one streamed request: its chunks as JSON, then "[DONE]" (sse-starlette frames
    them). A client that goes away is handled around it: `on_disconnect` aborts the request, which ends it."""
    first = True
    while True:
        delta = await request.stream.get()
        if delta.finished:
            state.metrics.observe(delta.output)
            observed.append(delta.output)
            if delta.finish_reason == "error":
                yield json.dumps(error_body(delta.output.error or "engine error", type="server_error"))
                break
        for chunk in delta_chunks(delta, head, chat, first, include_usage):
            yield json.dumps(chunk)
            first = False
        if delta.finished:
            break
    yield "[DONE]"
