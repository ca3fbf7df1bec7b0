"""`python -m minirt serve`: start the engine, serve HTTP with uvicorn, drain on SIGINT/SIGTERM.

Processes (vLLM v1's layout): by default the engine core runs in its own process (`minirt.serve.core`) and the
HTTP front end - parsing, tokenizing, validating, detokenizing, stop strings, SSE - in this one, so that no
client's work ever delays a step, and no step delays an answer such as /health. `--api-server-count N` runs N
front-end processes (`python -m minirt.serve.server`, each given the listening socket: the kernel hands each
new connection to one of them) over one engine core; this process then only supervises. `--in-process` keeps
everything on one event loop: `build_app(engine)` over the asyncio `Engine`, chapter 08's first server.

Shutdown (uvicorn's sequence, with a drain deadline added): stop listening, answer new requests on open
connections with 503, let the requests in flight finish for up to `--shutdown-timeout` seconds, then abort
those still running - each client still gets a complete answer, with finish_reason "abort" - and stop the
engine (the core process last). A model that cannot be loaded ends the command with status 1 and the reason,
before anything listens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from minirt.config import EngineConfig

logger = logging.getLogger("minirt.serve")

#: Engine settings given as text on the command line: how each field's type reads it.
_BOOL_WORDS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


def _bool(text: str) -> bool:
    if text.lower() not in _BOOL_WORDS:
        raise argparse.ArgumentTypeError(f"must be true or false (on/off, 1/0), got {text!r}")
    return _BOOL_WORDS[text.lower()]


def _auto_bool(text: str) -> bool | None:
    return None if text.lower() == "auto" else _bool(text)


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def add_engine_settings(p: argparse.ArgumentParser) -> None:
    """One `--flag` per `EngineConfig` field (`--max-num-seqs 64`, `--enable-prefix-caching false`,
    `--fused-ops auto`); a flag not given keeps the engine's default."""
    group = p.add_argument_group("engine settings (minirt.config.EngineConfig; default: the engine's)")
    for f in dataclasses.fields(EngineConfig):
        kind = str(f.type)
        parse = (_auto_bool if kind == "bool | None" else _bool if kind == "bool" else
                 _int_or_none if kind == "int | None" else int if kind == "int" else str)
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=parse, default=argparse.SUPPRESS,
                           metavar="NAME" if kind == "object" else kind.replace(" | ", "|").upper(),
                           help=f"default {f.default!r}")


def engine_settings(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """One flag per `minirt.serve.limits.ServerLimits` field; none without the serve extra (its module imports
    uvicorn and starlette), so that the other commands of `python -m minirt` still parse (`run` then says what is
    missing)."""
    try:
        from minirt.serve.limits import MAX_CONNECTIONS, RESERVED_FDS, ServerLimits
    except ImportError as e:
        p.add_argument_group(f"connection limits: need the serve extra (pip install 'minirt[serve]'; {e})")
        return

    d = ServerLimits(max_connections=1)
    g = p.add_argument_group("connection limits (minirt.serve.limits.ServerLimits; refusals in OpenAI's error shape)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"request body size; larger gets 413 (default {d.max_body_bytes})")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help=f"seconds for a request head to arrive; else 408 and close (default {d.header_timeout_s})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help=f"seconds for a request body to arrive after its head; else 408 (default {d.body_timeout_s})")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="seconds an idle connection stays open between requests; above the clients' own pool "
                        "timeouts (httpx: 5 s), so that the client closes first (default %(default)s)")
    g.add_argument("--max-connections", type=int, default=None,
                   help=f"open connections; beyond, the longest-idle one is closed, or 503 if all are being answered "
                        f"(default: {MAX_CONNECTIONS}, or fewer under the descriptor limit: {RESERVED_FDS} kept free, "
                        f"and the listen backlog)")


def limit_settings(args):
    """The `ServerLimits` of the flags; raises ValueError naming the flag."""
    from minirt.serve.limits import ServerLimits

    try:
        return ServerLimits(args.max_body_bytes, args.header_timeout, args.body_timeout, args.keep_alive_timeout,
                            args.max_connections)
    except ValueError as e:
        field, _, reason = str(e).partition(":")
        raise ValueError(f"--{field.removesuffix('_s').replace('_', '-')}:{reason}") from None


def raise_descriptor_limit(target: int = 65536) -> None:
    """Raise the soft limit on open files towards the hard one (vLLM's `set_ulimit` does the same at start-up)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to an argparse subparsers object."""
    from minirt.engine import DEFAULT_MODEL

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over the asyncio engine",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF-format checkpoint or hub id (default: embedded)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for admission; beyond, 429 with Retry-After (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is fastest for small models on a shared CPU)")
    add_limit_flags(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes sharing the listening socket and one engine core (default 1)")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine on the front end's event loop, in one process (chapter 08's first server)")
    add_engine_settings(p)
    return p


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          model_path: str | None = None, max_waiting: int = 256, shutdown_timeout: float = 30.0,
          log_level: str = "info", sockets=None, limits=None):
    """Build the app over `engine` and return the uvicorn server (call `.run()`, or `.serve()` in a loop).
    `limits`: a `minirt.serve.limits.ServerLimits` (default: its defaults)."""
    import uvicorn

    from minirt.serve.app import build_app
    from minirt.serve.limits import MAX_HEAD_BYTES, BodyLimit, ServerLimits, accept_backlog, protocol_factory
    from minirt.serve.shutdown import DrainingServer

    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {shutdown_timeout!r}")
    app = build_app(engine, model_name, model_path, max_waiting)
    # uvicorn's own deadline, after which it cancels handlers: later than the drain's, which answers them first
    limits = limits or ServerLimits()
    config = uvicorn.Config(BodyLimit(app, limits.max_body_bytes), host=host, port=port, log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=shutdown_timeout + 5,
                            http=protocol_factory(limits), timeout_keep_alive=limits.keep_alive_timeout_s,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES, backlog=accept_backlog())
    return DrainingServer(config, app.state.minirt, shutdown_timeout)


class BackgroundServer:
    """A server over `engine` on its own thread and event loop, on a free port of 127.0.0.1 (tests, notebooks):

        with BackgroundServer(engine) as url:     # "http://127.0.0.1:PORT"
            ...                                   # leaving drains and stops it, as SIGTERM does

    `settings` go to `serve` (max_waiting, shutdown_timeout, ...). The engine runs on the server's thread:
    read `engine.stats()` from outside only when no request is in flight."""

    def __init__(self, engine, host: str = "127.0.0.1", **settings):
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = serve(engine, host, self.sock.getsockname()[1], log_level="warning", **settings)
        self.thread = None

    def start(self, timeout_s: float = 30.0) -> str:
        import asyncio

        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name="minirt-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(args) -> int:
    """`python -m minirt serve`: 0 after a clean shutdown, 1 if the model cannot be loaded, 2 on bad settings or
    without the serve extra."""
    try:
        import minirt.serve.limits  # noqa: F401  (uvicorn, starlette: the serve extra)
    except ImportError as e:
        print(f"error: serve needs the serve extra: pip install 'minirt[serve]' ({e})", file=sys.stderr)
        return 2
    from minirt.serve.client import EngineClient
    from minirt.serve.core import EngineCoreStartError, start_engine_core

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    for flag, value in (("--max-waiting", args.max_waiting), ("--threads", args.threads),
                        ("--api-server-count", args.api_server_count)):
        if value is not None and value < 1:
            print(f"error: {flag}: must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.in_process and args.api_server_count > 1:
        print("error: --api-server-count: needs the engine core in its own process (drop --in-process)", file=sys.stderr)
        return 2
    try:
        raise_descriptor_limit()                  # before the limits, whose default max_connections reads it
        limits = limit_settings(args)             # bad limits refused before the model loads
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.in_process:
        return _run_in_process(args, limits)
    try:
        core = start_engine_core(args.model, engine_settings(args), args.threads)
    except EngineCoreStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    try:
        info = core.info
        if not info["has_tokenizer"]:
            return _no_tokenizer(args)
        c = info["config"]
        print(f"minirt serve: {args.model} on {c['device']} ({c['dtype']}), {c['num_kv_blocks']} KV blocks of "
              f"{c['block_size']}, max_model_len {c['max_model_len']}; engine core pid {core.popen.pid}",
              file=sys.stderr, flush=True)
        if args.api_server_count == 1:
            return _run_front_end(EngineClient(core.address, info), args, limits)
        return _run_front_ends(core, args)
    finally:
        core.stop()


def _run_in_process(args, limits) -> int:
    from minirt import Engine

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        engine = Engine(args.model, **engine_settings(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:            # noqa: BLE001 - whatever stops the load, say it and exit non-zero
        print(f"error: cannot load the model {args.model!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if engine.tokenizer is None:
        return _no_tokenizer(args)
    print(f"minirt serve: {args.model} on {engine.device} ({engine.model.dtype}), {engine.pool.num_blocks} KV blocks "
          f"of {engine.config.block_size}, max_model_len {engine.config.max_model_len}", file=sys.stderr, flush=True)
    return _run_front_end(engine, args, limits)


def _no_tokenizer(args) -> int:
    print(f"error: cannot serve the model {args.model!r}: it has no tokenizer, and the OpenAI API answers text",
          file=sys.stderr)
    return 1


def _run_front_end(engine, args, limits, sockets=None) -> int:
    """Serve HTTP over `engine` (an `Engine` or an `EngineClient`) with the connection `limits` until SIGINT or
    SIGTERM; drain, return 0."""
    try:
        server = serve(engine, args.host, args.port, args.served_model_name, args.model, args.max_waiting,
                       args.shutdown_timeout, args.log_level, limits=limits)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # After its graceful shutdown uvicorn raises the signal it caught once more, for the previous handler:
    # by then every request is answered and the engine stopped, so that handler ends the process with 0.
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def _run_front_ends(core, args) -> int:
    """`--api-server-count N`: bind the port here, start N front ends that inherit the socket, forward SIGINT and
    SIGTERM to them (each drains), wait for all. Their counters meet in prometheus_client's multiprocess folder."""
    from minirt.serve.limits import accept_backlog

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    sock.listen(accept_backlog())
    metrics_dir = tempfile.mkdtemp(prefix="minirt-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    spec = {"fd": sock.fileno(), "address": core.address, "info": core.info,
            "args": {k: v for k, v in vars(args).items() if k != "func" and _is_plain(v)}}
    procs = []
    try:
        for _ in range(args.api_server_count):
            p = subprocess.Popen([sys.executable, "-m", "minirt.serve.server"], stdin=subprocess.PIPE, text=True,
                                 pass_fds=[sock.fileno()], env=env)
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.close()
            procs.append(p)
        print(f"minirt serve: front ends pids {[p.pid for p in procs]} on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)

        def forward(signum, frame):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            codes = [p.wait() for p in procs]
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return max(codes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _exit_when_orphaned(parent_pid: int, every_s: float = 1.0) -> None:
    """A front end whose supervisor is gone (killed outright) drains and exits, as if it had been sent SIGTERM."""
    while os.getppid() == parent_pid:
        time.sleep(every_s)
    os.kill(os.getpid(), signal.SIGTERM)


def _is_plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _front_end_main() -> int:
    """One of N front ends (`python -m minirt.serve.server`): its spec, one JSON line on stdin, names the
    inherited listening socket, the engine core's address and `describe` info, and the command's arguments."""
    from minirt.serve.client import EngineClient

    spec = json.loads(sys.stdin.readline())
    args = argparse.Namespace(**spec["args"])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    sock = socket.socket(fileno=spec["fd"])
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    raise_descriptor_limit()
    return _run_front_end(EngineClient(spec["address"], spec["info"]), args, limit_settings(args), sockets=[sock])


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


if __name__ == "__main__":
    raise SystemExit(_front_end_main())
