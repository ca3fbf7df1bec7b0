"""Chapter 08: limits on every connection - body size, read timeouts, idle keep-alive, open connections.

A server on an open port meets clients that send too much, too slowly, or nothing at all; each limit bounds
what one of them can hold (`ServerLimits`, one `python -m minirt serve` flag each):

    max_body_bytes        a request body larger than this gets 413 (Content-Length first, then counted as it
                          streams in, so a chunked body cannot slip past)
    header_timeout_s      a request's head must arrive within this many seconds of its first byte (of the
                          connection, for its first request); else 408 and the connection closes (slowloris)
    body_timeout_s        its body within this many seconds of its head; else 408 and the connection closes
    keep_alive_timeout_s  a connection idle between two requests closes after this long
    max_connections       open connections. A newcomer beyond it closes the connection idle longest, else the
                          one reading a request body longest (a slow or silent socket holds nothing worth
                          keeping); if every one is being answered, the newcomer gets 503 with Retry-After. The default stays below
                          the process's file-descriptor limit, so accept() never runs out of descriptors.

Where each lives: the body size in an ASGI middleware (`BodyLimit`), the rest in `LimitedH11Protocol`, uvicorn's
h11 protocol with one deadline per connection, checked by a sweep a few times per shortest timeout. uvicorn
times only keep-alive, from the end of a response: a socket that never completes a request head holds its
descriptor for ever. Every answer is OpenAI's error JSON (`protocol.error_body`). The same limits elsewhere:
nginx's client_max_body_size, client_header_timeout, client_body_timeout, keepalive_timeout and
worker_connections; TGI's --payload-limit; uvicorn's --limit-concurrency (which answers 503 in plain text).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import resource
import time
from dataclasses import dataclass

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from minirt.serve.protocol import error_body

logger = logging.getLogger("minirt.serve")

#: File descriptors kept free beyond the connections: the model's files, logs, the engine's own sockets.
RESERVED_FDS = 64
#: Connections at most by default, where the descriptor limit allows more.
MAX_CONNECTIONS = 2048
#: Bytes of a body already answered (413) read and dropped at most, so that the client can read the answer.
DRAIN_BYTES = 16 * 2**20
#: Bytes of a request head still incomplete at most (h11's `max_incomplete_event_size`); beyond, 400. A head that
#: arrives whole in one read (asyncio reads up to 256 KiB) is parsed whatever its size.
MAX_HEAD_BYTES = 64 * 2**10
#: Seconds a refused connection may take to read its 503 before it is closed.
LINGER_S = 1.0


def _soft_fd_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def accept_backlog() -> int:
    """The listen backlog: also how many connections asyncio accepts in one go, each holding a descriptor before it
    is refused or makes room (`_accept_connection` loops `backlog` times). An eighth of the descriptor limit,
    within [16, 2048] (uvicorn's default, 2048, would let one burst exhaust a limit of 1024)."""
    soft = _soft_fd_limit()
    return 2048 if soft is None else max(16, min(2048, soft // 8))


def default_max_connections() -> int:
    """`MAX_CONNECTIONS`, or fewer: the soft descriptor limit less those open now, `RESERVED_FDS`, and twice the
    accept backlog (a burst accepted in one go, and as many connections closing to make room for it)."""
    soft = _soft_fd_limit()
    if soft is None:
        return MAX_CONNECTIONS
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 16
    return max(1, min(MAX_CONNECTIONS, soft - open_now - RESERVED_FDS - 2 * accept_backlog()))


@dataclass
class ServerLimits:
    """The limits of one server (see the module docstring). `max_connections=None`: `default_max_connections()`,
    decided by `resolved()`.
    Raises ValueError naming the field for a value out of range."""

    max_body_bytes: int = 8 * 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 75.0
    max_connections: int | None = None

    def __post_init__(self):
        if not (isinstance(self.max_body_bytes, int) and self.max_body_bytes >= 1):
            raise ValueError(f"max_body_bytes: must be an integer >= 1, got {self.max_body_bytes!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")
        if self.max_connections is not None and not (isinstance(self.max_connections, int)
                                                      and self.max_connections >= 1):
            raise ValueError(f"max_connections: must be an integer >= 1, got {self.max_connections!r}")

    def resolved(self) -> "ServerLimits":
        """These limits with `max_connections` decided: `default_max_connections()` where it is None. Called when
        the server is built, after the model is loaded, so that the descriptors the load keeps open are counted."""
        if self.max_connections is not None:
            return self
        return dataclasses.replace(self, max_connections=default_max_connections())

    @property
    def sweep_s(self) -> float:
        """How often deadlines are checked: a quarter of the shortest timeout, within [0.05, 1] s."""
        return min(1.0, max(0.05, min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_timeout_s) / 4))


def raw_error(status: int, reason: str, message: str, type: str, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 error response with OpenAI's error JSON, for a connection whose h11 state is not ours to
    use (refused before a request, or timed out in the middle of one). It always closes the connection."""
    body = json.dumps(error_body(message, type=type)).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
             "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class BodyTooLarge(HTTPException):
    """413: raised inside the app by `BodyLimit`'s receive (FastAPI passes HTTPExceptions on to the handler)."""

    def __init__(self, limit: int, size: int | None = None):
        seen = f"{size} bytes" if size is not None else "more bytes than that"
        super().__init__(413, f"body: larger than max_body_bytes = {limit} (--max-body-bytes): {seen}")


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_body_bytes`, from Content-Length before the app runs, else counted
    chunk by chunk as the app reads it. (The rest of an oversized body is read and dropped by the protocol, within
    the body timeout: a client that is still sending when the connection closes may lose the answer.) At start-up
    it also quiets the event loop's report of accept() failures (`quiet_accept_errors`)."""

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            quiet_accept_errors(asyncio.get_running_loop())
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            body = json.dumps(error_body(BodyTooLarge(limit, int(length)).detail)).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """Report accept() failing for want of descriptors (EMFILE) once per `every_s` seconds, with a count, instead of
    asyncio's traceback per attempt (up to the listen backlog each retry: tens of thousands of lines a minute)."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiet_accept_errors", False):
        return
    seen = {"last": -float("inf"), "count": 0}

    def handler(loop, context):
        if context.get("message") != "socket.accept() out of system resource":
            return previous(loop, context) if previous else loop.default_exception_handler(context)
        seen["count"] += 1
        now = time.monotonic()
        if now - seen["last"] >= every_s:
            logger.warning("cannot accept connections: %s (%d times in %.0f s); lower --max-connections or raise "
                           "the descriptor limit (ulimit -n)", context.get("exception"), seen["count"], every_s)
            seen["last"], seen["count"] = now, 0

    handler.quiet_accept_errors = True
    loop.set_exception_handler(handler)


class ConnectionTable:
    """The open connections of one server, oldest first, and the sweep that enforces their deadlines."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.open: dict[LimitedH11Protocol, None] = {}
        self.refusing: set[asyncio.Transport] = set()
        self.counts = {"refused": 0, "evicted": 0, "timed_out": 0}
        self._sweep: asyncio.TimerHandle | None = None

    def admit(self, conn: "LimitedH11Protocol") -> bool:
        """Make room for `conn` if the table is full, closing the connection idle longest, else the one reading a
        request body longest, and add it; False if every open connection is being answered."""
        if len(self.open) >= self.limits.max_connections:
            idle = [c for c in self.open if c.is_idle()]
            reading = [] if idle else [c for c in self.open if c.is_reading_body()]
            if not idle and not reading:
                return False
            victim = min(idle, key=lambda c: c.waiting_since) if idle else min(reading, key=lambda c: c.body_started)
            self.counts["evicted"] += 1
            victim.close("evicted")
        self.open[conn] = None
        if self._sweep is None:
            self._sweep = conn.loop.call_later(self.limits.sweep_s, self.sweep, conn.loop)
        return True

    def sweep(self, loop) -> None:
        now = time.monotonic()
        for conn in list(self.open):
            expired = conn.expired(now)
            if expired:
                self.counts["timed_out"] += 1
                conn.close(expired)
        self._sweep = loop.call_later(self.limits.sweep_s, self.sweep, loop) if self.open else None


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with `ServerLimits`' deadlines and connection cap (`ConnectionTable`).

    A connection is always in one of three states, read from h11's: waiting for a request head (idle, or a head
    arriving: `is_idle`), reading a body (h11's SEND_BODY: the app reads it, `is_reading_body`, or after an early
    answer such as 413 the protocol drops it), or busy (the request is read, the app answers: no deadline, streams
    may run long, never evicted)."""

    def __init__(self, config, server_state, app_state, _loop=None, *, table: ConnectionTable):
        super().__init__(config, server_state, app_state, _loop)
        self.table = table
        self.limits = table.limits
        self.refused = False
        self.waiting_since = time.monotonic()    # the state began: connected, or the last response ended
        self.head_started: float | None = None   # the first byte of the head being read
        self.body_started = 0.0                  # the head arrived
        self.dropped = 0                         # body bytes read after the answer was sent
        self.served = 0

    # ------------------------------------------------------------------ states
    def is_idle(self) -> bool:
        """No request in flight: waiting for a head (or part of one)."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def is_reading_body(self) -> bool:
        """The request's head is in, its body is not, and no answer has started."""
        return self.conn.their_state is h11.SEND_BODY and (self.cycle is None or not self.cycle.response_started)

    def expired(self, now: float) -> str | None:
        """The limit this connection has passed, if any: "head", "body" or "idle"."""
        limits = self.limits
        if self.conn.their_state is h11.SEND_BODY:
            return "body" if now - self.body_started > limits.body_timeout_s else None
        if not self.is_idle():
            return None
        if self.head_started is not None:
            return "head" if now - self.head_started > limits.header_timeout_s else None
        patience = limits.keep_alive_timeout_s if self.served else limits.header_timeout_s
        return "idle" if now - self.waiting_since > patience else None

    def close(self, why: str) -> None:
        """Close, with a 408 in OpenAI's shape when a request was being read (nothing for a silent socket)."""
        if self.transport is None or self.transport.is_closing():
            return
        logger.debug("closing connection %s: %s", self.client, why)
        self.table.open.pop(self, None)              # its descriptor is on the way out: room for another
        if why in ("head", "body") and (self.cycle is None or not self.cycle.response_started):
            timeout = self.limits.header_timeout_s if why == "head" else self.limits.body_timeout_s
            flag = "--body-timeout" if why == "body" else "--header-timeout"
            self.transport.write(raw_error(408, "Request Timeout", f"request {why}: not received within {timeout} s "
                                           f"({flag})", "invalid_request_error"))
        self.transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        if not self.table.admit(self):
            self.refuse(transport)
            return
        super().connection_made(transport)

    def refuse(self, transport) -> None:
        """503 in OpenAI's shape, then close once the client has read it (or after `LINGER_S`): closing at once,
        with the client's request unread, would send a reset that may destroy the answer before it is read."""
        self.refused = True
        self.table.counts["refused"] += 1
        if len(self.table.refusing) >= RESERVED_FDS // 2:     # a flood: no descriptor to spare for lingering
            transport.abort()
            return
        self.table.refusing.add(transport)
        transport.write(raw_error(503, "Service Unavailable", f"server is at max_connections = "
                                  f"{self.limits.max_connections} open connections, all busy; retry later",
                                  "server_error", {"retry-after": "1"}))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.head_started is None and self.is_idle():
            self.head_started = time.monotonic()
        reading_body = self.conn.their_state is h11.SEND_BODY
        if reading_body and self.cycle is not None and self.cycle.response_complete:
            self.dropped += len(data)
            if self.dropped > max(4 * self.limits.max_body_bytes, DRAIN_BYTES):   # an endless body: stop reading
                self.transport.close()
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.head_started is not None:
            self.head_started = None                            # a head arrived
            self.body_started = time.monotonic()
            self.dropped = 0

    def eof_received(self) -> None:
        if not self.refused:
            super().eof_received()

    def connection_lost(self, exc) -> None:
        if self.refused:
            self.table.refusing.discard(self.transport)
            return
        self.table.open.pop(self, None)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            super().resume_writing()

    def on_response_complete(self) -> None:
        self.served += 1
        self.waiting_since = time.monotonic()
        self.head_started = None
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE:               # a pipelined request was already buffered
            self.body_started = time.monotonic()

    def send_400_response(self, msg: str) -> None:
        """An unparseable request (or a head over `MAX_HEAD_BYTES`): 400 in OpenAI's shape, then close."""
        self.transport.write(raw_error(400, "Bad Request", f"request: invalid HTTP ({msg.rstrip('.')})",
                                       "invalid_request_error"))
        self.transport.close()


def protocol_factory(limits: ServerLimits):
    """What uvicorn's `Config(http=...)` takes: builds a `LimitedH11Protocol` per connection, over one table."""
    table = ConnectionTable(limits.resolved())

    def make(config, server_state, app_state, _loop=None):
        return LimitedH11Protocol(config, server_state, app_state, _loop, table=table)

    make.table = table
    return make
