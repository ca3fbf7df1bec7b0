"""Chapter 09: one process per rank, and each step's batch sent from rank 0 to the others.

The engine's own process is rank 0: it owns the scheduler, the event loop and the sampling, as in nano-vllm
(whose `ModelRunner` is rank 0 in the engine's process and spawns the others). The other ranks are processes
started as clean interpreters running the rank's own entry point (`RankProcess`: `python -m minirt.parallel.rank`),
so they never re-run the parent's main module and start however the parent was started (a script without a
`__main__` guard, standard input, `python -c`, a notebook kernel); each reads its `RankSpec` from rank 0's TCP store,
loads the checkpoint, keeps its shard and waits in `serve` for steps. A step reaches them through
`torch.distributed` collectives on a gloo (CPU) group: a fixed header, then one int64 tensor with the packed batch
(`pack_step` / `unpack_step`). mini-sglang keeps such a gloo CPU group beside NCCL for the same reason: metadata
lives on the host, and a gloo wait can be long.

Two groups: the default one (gloo on the CPU, NCCL on GPUs) runs the model's all-reduces with the *step timeout*
(`MINIRT_TP_TIMEOUT_S`, default 60 s): a rank that dies or hangs in a step turns into an error on the others
within it. The control group (gloo) carries the steps with a long timeout, since an idle engine may send none
for hours; a rank that waits there and loses rank 0 (its process died) fails at once on the closed connection, and
a watchdog thread ends it when its parent process is gone (its stdin, a pipe from rank 0, closes).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minirt.model_runner import StepInputs

logger = logging.getLogger(__name__)

#: Seconds a collective of a step may wait for the other ranks before it fails (all-reduce, gather).
STEP_TIMEOUT_S = 60.0       # MINIRT_TP_TIMEOUT_S overrides it when the runner is built
#: Seconds the ranks may take to start: spawn, import, load the checkpoint, shard.
STARTUP_TIMEOUT_S = float(os.environ.get("MINIRT_TP_STARTUP_TIMEOUT_S", "600"))
#: The control group's timeout: an idle rank waits this long for the next step.
IDLE_TIMEOUT = datetime.timedelta(days=365)
#: Seconds `RankGroup.close` waits for each rank to exit before killing it.
JOIN_TIMEOUT_S = 10.0

#: A rank's last line on its stderr when it fails: this prefix, then its error.
ERROR_MARK = "minirt-rank-error: "

STOP, STEP = 0, 1
HEADER = 7        # command, num_tokens, num_seqs, num_sampled, max_query_len, num_block_entries, payload length


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its share of the engine: the checkpoint, dtype and device, the plan, the KV pool,
    and where to meet (a TCP store on rank 0's host). device: "cpu" or "cuda" (rank r on cuda:`first_device + r`)."""

    checkpoint: str
    dtype: str
    device: str
    first_device: int
    world_size: int
    plan: object
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    host: str
    port: int
    num_threads: int
    step_timeout_s: float

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def device_of(self, rank: int) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", self.first_device + rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ the step on the wire
def pack_step(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's host lists as `(header [HEADER], payload [n])`, int64: input_ids, positions, slots, query_start_loc,
    context_lens, the block tables' lengths, their entries, sample_rows, one after another."""
    lens = [len(t) for t in step.block_tables]
    flat = [b for t in step.block_tables for b in t]
    payload = torch.tensor(step.input_ids + step.positions + step.slots + step.query_start_loc + step.context_lens
                           + lens + flat + step.sample_rows, dtype=torch.long)
    header = torch.tensor([STEP, len(step.input_ids), len(step.context_lens), len(step.sample_rows),
                           step.max_query_len, len(flat), len(payload)], dtype=torch.long)
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """`pack_step`'s inverse (the requests stay on rank 0: `sample_requests` is empty)."""
    _, n, s, k, max_q, _, _ = header.tolist()
    values = payload.tolist()
    at = 0

    def take(count):
        nonlocal at
        at += count
        return values[at - count:at]

    step = StepInputs(input_ids=take(n), positions=take(n), slots=take(n), query_start_loc=take(s + 1),
                      context_lens=take(s), max_query_len=max_q)
    lens = take(s)
    flat = take(sum(lens))
    starts = itertools.accumulate(lens, initial=0)
    step.block_tables = [flat[a:a + m] for a, m in zip(starts, lens)]
    step.sample_rows = take(k)
    return step


def send_step(step: StepInputs | None, group, timeout_s: float) -> None:
    """Rank 0: broadcast a step (None: the stop command) on the control group. A root's broadcast waits for the
    receivers too, so it is bounded here by `timeout_s` (the control group's own timeout is the long idle one)."""
    if step is None:
        tensors = [torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long)]
    else:
        tensors = list(pack_step(step))
    timeout = datetime.timedelta(seconds=timeout_s)
    for t in tensors:
        dist.broadcast(t, src=0, group=group, async_op=True).wait(timeout)


def receive_step(group) -> StepInputs | None:
    """Another rank: wait for rank 0's next step on the control group; None for the stop command."""
    header = torch.empty(HEADER, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    if header[0].item() == STOP:
        return None
    payload = torch.empty(header[6].item(), dtype=torch.long)
    dist.broadcast(payload, src=0, group=group)
    return unpack_step(header, payload)


# ------------------------------------------------------------------------------------------ process groups
def join_groups(spec: RankSpec, rank: int, store) -> object:
    """Join the default group (the model's collectives, with the step timeout) and create the control group; returns
    the control group. Every rank calls it, in the same order."""
    kwargs = {}
    if spec.backend == "nccl":
        kwargs["device_id"] = spec.device_of(rank)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.step_timeout_s), **kwargs)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _watch_parent() -> None:
    """End this process when its parent (rank 0) is gone, whatever this process is blocked in: its stdin is a pipe
    from the parent, which the system closes when the parent exits."""

    def watch():
        while os.read(0, 1):          # the raw descriptor: a daemon thread in sys.stdin's buffer aborts the exit
            pass
        os._exit(3)

    threading.Thread(target=watch, name="minirt-parent-watchdog", daemon=True).start()


def rank_main(host: str, port: int, rank: int, world_size: int) -> None:
    """The body of ranks 1..N-1 (`python -m minirt.parallel.rank`): read the `RankSpec` from rank 0's store, join,
    build the rank's runner, serve steps until the stop command. Any error is written as the last line of stderr
    (`ERROR_MARK`, then the error) and ends the process with exit code 1, which the others see as a closed
    connection in their next collective."""
    _watch_parent()
    try:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        spec: RankSpec = pickle.loads(store.get("spec"))
        torch.set_num_threads(spec.num_threads)
        if spec.device == "cuda":
            torch.cuda.set_device(spec.device_of(rank))
        store.set(f"joined/{rank}", "1")
        control = join_groups(spec, rank, store)
        from minirt.parallel.runner import build_rank_runner

        runner = build_rank_runner(spec, rank, control)
        store.set(f"ready/{rank}", "1")
        runner.serve()
    except BaseException as e:             # noqa: BLE001 - report, then end this rank
        try:
            traceback.print_exc()
            message = f"{type(e).__name__}: {e}".replace("\n", " ")
            print(ERROR_MARK + message, file=sys.stderr, flush=True)
        finally:
            os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


class RankProcess:
    """One rank's process: `python -m minirt.parallel.rank HOST PORT RANK WORLD_SIZE`, a clean interpreter with the
    directory holding this `minirt` first on its path. Its stdin is a pipe from this process (`_watch_parent`); its
    stderr goes to a temporary file, read back by `report`. `pid`, `exitcode`, `is_alive`, `join` and `kill` as a
    `multiprocessing.Process`."""

    def __init__(self, spec: RankSpec, rank: int):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.stderr = tempfile.TemporaryFile()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "minirt.parallel.rank", spec.host, str(spec.port), str(rank), str(spec.world_size)],
            stdin=subprocess.PIPE, stderr=self.stderr, env={**os.environ, "PYTHONPATH": path})
        self.pid = self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def report(self) -> str | None:
        """The rank's own error: the line it reported (`ERROR_MARK`), else, once it has exited, the last line of its
        stderr (an error raised before its handler, a crash)."""
        if self.stderr.closed:
            return None
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 8192, max(0, size - 8192)).decode(errors="replace")   # pread: the rank's offset stays
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        reported = [line.removeprefix(ERROR_MARK) for line in lines if line.startswith(ERROR_MARK)]
        if reported:
            return reported[-1]
        return lines[-1] if lines and self.exitcode is not None else None

    def release(self) -> None:
        """Close the pipe and the stderr file (after the process has ended: a closed pipe ends a live rank)."""
        self.popen.stdin.close()
        self.stderr.close()


def short_message(exc: BaseException) -> str:
    """The first sentence of an error, without gloo's source location (`[.../pair.cc:537] Read error ...`)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


class RankGroup:
    """Rank 0's handle on the other ranks: their processes, the TCP store, the control group, and what went wrong.

    `start` starts ranks 1..N-1 (`RankProcess`) and joins the groups with them; `check` raises if one has exited;
    `fail` turns an error of a step into one that names the ranks' own errors and exit codes, and closes the group;
    `close` sends the stop command, joins every rank (killing any that does not exit within `JOIN_TIMEOUT_S`) and
    destroys the process groups. Idempotent, also called at interpreter exit or when the engine is garbage-collected."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.processes: list[RankProcess] = []
        self.control = None
        self.store = None
        self.failure: str | None = None
        self.closed = False
        self.joined = False          # this group initialized torch.distributed here (and destroys it on close)

    def start(self) -> object:
        """Start the ranks (the spec waits for them in the store) and join the groups as rank 0; returns the control
        group. Raises RuntimeError if a rank exits or the startup timeout passes."""
        spec = self.spec
        self.store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
        self.store.set("spec", pickle.dumps(spec))
        self.processes = [RankProcess(spec, rank) for rank in range(1, spec.world_size)]
        self.wait_for("joined")
        self.control = join_groups(spec, 0, self.store)
        self.joined = True
        return self.control

    def wait_for(self, what: str) -> None:
        """Wait until every rank has set `what/<rank>` in the store, watching that none exits meanwhile."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.spec.world_size):
            while not self.store.check([f"{what}/{rank}"]):
                if self.exited():
                    raise RuntimeError("a rank exited while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor_parallel_size: rank {rank} did not start within "
                                       f"{STARTUP_TIMEOUT_S:.0f} s (MINIRT_TP_STARTUP_TIMEOUT_S)")
                time.sleep(0.05)

    def errors(self, wait_s: float = 0.0) -> list[str]:
        """The ranks' reports of their own errors (`RankProcess.report`), waiting up to `wait_s` for a first one."""
        deadline = time.monotonic() + wait_s
        while True:
            out = [f"rank {i + 1}: {m}" for i, p in enumerate(self.processes) if (m := p.report()) is not None]
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)

    def exited(self) -> list[str]:
        return [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.processes)
                if p.exitcode is not None]

    def check(self) -> None:
        """Raise RuntimeError if the group failed before, or a rank has exited (naming it, its code and its error)."""
        if self.failure is not None:
            raise RuntimeError(f"tensor-parallel group is down ({self.failure}); build a new engine")
        if self.exited():
            raise self.fail(None)

    def fail(self, exc: BaseException | None) -> RuntimeError:
        """Close the group after an error in a step (a collective timed out, a rank died) and return the error to
        raise: what rank 0 saw, the other ranks' own errors, and their exit codes."""
        parts = [f"{type(exc).__name__}: {short_message(exc)}"] if exc is not None else []
        parts += self.errors(wait_s=1.0 if exc is not None else 0.2) + self.exited()
        if any("timed out" in p.lower() for p in parts):
            parts.append(f"a rank did not answer within {self.spec.step_timeout_s:g} s (MINIRT_TP_TIMEOUT_S)")
        self.failure = "; ".join(parts) or "unknown error"
        self.close(graceful=False)
        return RuntimeError(f"tensor-parallel step failed: {self.failure}")

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failure is None:
            self.failure = "closed"
        if graceful and self.control is not None and not self.exited():
            try:
                send_step(None, self.control, JOIN_TIMEOUT_S)
            except Exception:                # noqa: BLE001 - a rank is gone: kill the rest below
                logger.warning("tensor-parallel close: could not send the stop command", exc_info=True)
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)
            p.release()
        if self.joined and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:                # noqa: BLE001 - a broken group: nothing more to release
                logger.warning("tensor-parallel close: destroy_process_group failed", exc_info=True)
        self.control = None
        self.store = None
