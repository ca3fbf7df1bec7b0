"""Chapter 08: the engine core in its own process - it owns an `Engine` and runs only its steps.

    front end(s): HTTP, tokenizer, validation,    --ADD / ABORT-->    engine core: schedule, run the model,
    detokenizer, stop strings, SSE (client.py)    <--OUTPUTS-----     free blocks (this module)

vLLM v1 cuts its server in the same place (`EngineCore` behind `EngineCoreClient` over ZMQ, msgspec structs;
SGLang: tokenizer manager / scheduler / detokenizer): whatever the front ends do with text and sockets, the
loop that runs the steps never waits for it. One ZMQ ROUTER socket takes every front end's DEALER
(`--api-server-count N`); each message arrives with its sender's identity, and a request's outputs go back to
the front end that added it. Messages are msgpack lists of plain values, never pickles:

    front end -> core  [HELLO]                                      a front end connected: it gets OUTPUTS from now on
                       [ADD, request_id, prompt_token_ids, params]  params: `SamplingParams`' fields
                       [ABORT, [request_id, ...]]
    core -> front end  [OUTPUTS, [[request_id, new_token_ids, finish_reason, error, num_cached_tokens], ...],
                        stats, num_added]                           one per front end per loop turn that changed
                                                                    anything; stats: `Engine.stats()`; num_added:
                                                                    the ADDs taken from that front end so far

The core checks EOS, stop ids and `max_new_tokens` (it must free the seat); stop strings need the text,
so the front end checks them and sends ABORT (`params` arrive without them). The core runs the engine as
`minirt.LLM` does: `step_fn` in a plain loop, with no asyncio and no tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

import msgpack
import zmq

from minirt.engine import EngineFailedError
from minirt.sampling import SamplingParams

logger = logging.getLogger("minirt.serve")

HELLO, ADD, ABORT, OUTPUTS = 0, 1, 2, 3

#: How often an idle core checks that the process that started it is still alive (seconds).
PARENT_CHECK_S = 1.0


class EngineCore:
    """The loop of the engine-core process: take messages, run a step when there is work, send what changed."""

    def __init__(self, engine, address: str):
        self.engine = engine
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        # No high-water mark: a ROUTER drops what it cannot queue, and a dropped finish would hang a client.
        # ROUTER_MANDATORY: a send to a front end that went away raises instead of vanishing silently.
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.LINGER, 0)):
            self.socket.setsockopt(option, value)
        self.socket.bind(address)
        self.outbox: dict[bytes, list] = {}       # front end -> outputs for it this turn
        self.num_added: dict[bytes, int] = {}
        self.live: dict[str, tuple] = {}          # request id -> (request, front end, output tokens sent)

    def run(self, parent_pid: int | None = None) -> None:
        while True:
            if not self.engine.scheduler.has_work() and not self.socket.poll(PARENT_CHECK_S * 1000):
                if parent_pid is not None and os.getppid() != parent_pid:
                    return                         # orphaned: whoever started this core is gone
                continue
            changed = self.receive()
            if self.engine.scheduler.has_work():
                self.step()
                changed = True
            if changed:
                self.send()

    def receive(self) -> bool:
        """Handle every message already queued; True if there was one."""
        got = False
        while True:
            try:
                client, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            message = msgpack.unpackb(payload)
            self.outbox.setdefault(client, [])
            self.num_added.setdefault(client, 0)
            if message[0] == ADD:
                self.add(client, *message[1:])
            elif message[0] == ABORT:
                for request_id in message[1]:
                    self.engine.abort(request_id, "aborted by the front end")

    def add(self, client: bytes, request_id: str, prompt_token_ids: list[int], params: dict) -> None:
        self.num_added[client] += 1
        engine = self.engine
        try:
            if engine._failure is not None:
                raise EngineFailedError(f"engine failed ({engine._failure}); restart the server")
            request = engine._add_request(prompt_token_ids, SamplingParams(**params), request_id)
        except (ValueError, EngineFailedError) as e:    # the front end validated: this is a race or a failed core
            self.outbox[client].append([request_id, [], "error", str(e), 0])
            return
        self.live[request_id] = (request, client, 0)

    def step(self) -> None:
        engine = self.engine
        try:
            if not engine.step_fn():   # validated requests always fit: no progress is a bug, never a wait
                raise RuntimeError("the scheduler could not schedule any of the requests it holds")
        except Exception as e:         # noqa: BLE001 - a failed step resolves every request, as `Engine` does
            engine._fail_all(e)

    def send(self) -> None:
        """Each live request's new tokens (and its end) to its front end, then the stats to every front end."""
        for request_id, (request, client, sent) in list(self.live.items()):
            new = request.token_ids[request.num_prompt_tokens + sent:]
            if request.is_finished:
                del self.live[request_id]
                self.outbox[client].append([request_id, new, request.finish_reason, request.error,
                                            request.num_cached_tokens])
            elif new:
                self.live[request_id] = (request, client, sent + len(new))
                self.outbox[client].append([request_id, new, None, None, request.num_cached_tokens])
        stats = self.engine.stats()
        for client, outputs in list(self.outbox.items()):
            try:
                self.socket.send_multipart([client, msgpack.packb([OUTPUTS, outputs, stats, self.num_added[client]])])
            except zmq.ZMQError:           # that front end is gone: its requests have nobody to answer
                self.forget(client)
                continue
            outputs.clear()

    def forget(self, client: bytes) -> None:
        del self.outbox[client], self.num_added[client]
        for request_id, (_, owner, _) in list(self.live.items()):
            if owner == client:
                self.engine.abort(request_id, "front end gone")
                del self.live[request_id]


def describe(engine) -> dict:
    """What a front end needs to know about the engine (msgpack-able): its resolved settings and the model's."""
    config = {k: v for k, v in dataclasses.asdict(engine.config).items() if k not in ("device", "dtype")}
    return {"config": {**config, "device": str(engine.device), "dtype": str(engine.model.dtype).removeprefix("torch.")},
            "checkpoint_path": str(engine.model.checkpoint_path), "eos_token_ids": sorted(engine.eos_token_ids),
            "has_tokenizer": engine.tokenizer is not None, "stats": engine.stats()}


def run_engine_core(address: str, model: str, settings: dict, threads: int | None = None, ready=print) -> int:
    """The engine-core process's body: load, call `ready` with {"ready": describe(engine)} (or {"error": message,
    "status": exit status}), then serve `address` until terminated (SIGTERM) or orphaned."""
    # Ctrl-C reaches the whole process group: the front end decides when the core stops (after draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from minirt import Engine

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        engine = Engine(model, **settings)
    except ValueError as e:
        ready({"error": str(e), "status": 2})
        return 2
    except Exception as e:            # noqa: BLE001 - whatever stops the load, say it
        ready({"error": f"cannot load the model {model!r}: {type(e).__name__}: {e}", "status": 1})
        return 1
    info = describe(engine)
    engine.tokenizer = None           # text is the front end's job: the core's requests never detokenize
    core = EngineCore(engine, address)
    ready({"ready": info})
    core.run(parent_pid=os.getppid())
    return 0


@dataclasses.dataclass
class EngineCoreProcess:
    """A started engine-core process: `address` to connect front ends to, `info` from `describe`."""

    popen: subprocess.Popen
    address: str
    info: dict
    folder: str

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class EngineCoreStartError(RuntimeError):
    """The engine core did not start; `status` is the exit status the command line should end with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def start_engine_core(model: str, settings: dict, threads: int | None = None,
                      timeout_s: float = 600.0) -> EngineCoreProcess:
    """Start the engine core as a clean interpreter (`python -m minirt.serve.core`, its spec as one JSON line on
    stdin: no CUDA or thread state is inherited, and no `__main__` is re-imported) and wait until it has loaded
    the model and listens on an ipc:// socket in a private folder. Raises EngineCoreStartError with the reason
    (status 2 for bad settings, 1 for a model that does not load)."""
    folder = tempfile.mkdtemp(prefix="minirt-core-")
    address = f"ipc://{folder}/engine-core"
    spec = {"address": address, "model": str(model), "settings": settings, "threads": threads}
    popen = subprocess.Popen([sys.executable, "-m", "minirt.serve.core"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    popen.stdin.write(json.dumps(spec) + "\n")
    popen.stdin.close()
    core = EngineCoreProcess(popen, address, {}, folder)
    message = {}
    ready, _, _ = select.select([popen.stdout], [], [], timeout_s)
    if ready:
        line = popen.stdout.readline()
        message = json.loads(line) if line else {}
    if "ready" not in message:
        core.stop()
        raise EngineCoreStartError(message.get("status", 1), message.get(
            "error", f"the engine core exited with status {popen.poll()} while loading" if ready else
            f"the engine core did not start within {timeout_s} s"))
    core.info = message["ready"]
    return core


def _main() -> int:
    spec = json.loads(sys.stdin.readline())
    out = sys.stdout

    def ready(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    sys.stdout = sys.stderr           # the reply line is the only thing on stdout
    return run_engine_core(spec["address"], spec["model"], spec["settings"], spec["threads"], ready)


if __name__ == "__main__":
    raise SystemExit(_main())
