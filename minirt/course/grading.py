"""Grade submitted exercise notebooks: `python -m minirt grade SUBMISSIONS... [--out grades.csv] [--jobs N]
[--sandbox auto|bwrap|user|none] [--seed N]`.

Verdicts are decided here, not in the student's process. Each submission runs in a worker
(`minirt.course.worker`) inside a sandbox (`minirt.course.sandbox`: bubblewrap where it works, else an
unprivileged user; resource limits either way). The worker runs the code cells top to bottom, one IPython
shell, each cell interrupted after `--timeout` seconds. At a check cell it takes the task's function or
class (the check call's argument) and waits; this process then sends it every case's inputs as plain data
(`minirt.course.wire`: JSON, tensors as raw bytes, never pickle), receives what the student's code returned
or raised, and compares it with the reference, which runs here (`checks.compare`, the same comparison the
notebook's check cell makes). Nothing the worker prints or patches changes a verdict: the check cells are
not run there, and their PASS line is never read.

What the grader trusts is the solutions directory (`solutions/` of the repository, or `--solutions DIR`)
and its own `minirt`: the tasks, their points and the source of every check cell come from there.

* A check cell is found by its metadata (`{"minirt": {"task": "ex03.slot_mapping", "points": 1}}`) or by
  the `checks.ex03_slot_mapping(` call in its source. If its source differs from the solution's (compared
  by a SHA-256 of the source with trailing whitespace removed), the task scores 0: "check cell edited"
  (the edited cell then runs as an ordinary cell). A missing check cell scores 0 as well.
* A graded function or class that is minirt's own implementation, or calls it, scores 0: the worker makes the
  task's reference raise while the student's code runs, and the source screen adds notes and warnings
  (`minirt.course.provenance` says what is and is not caught). Warnings cost no point (a column of the CSV).
* A submission that raises, hangs (interrupted after `--timeout` seconds; a worker that does not stop is
  killed), kills its worker (the tasks after it score 0), floods its output (its worker is stopped after
  16 MB), sends an answer over the cap or a message outside the protocol, loses only its own points; the
  other submissions are graded normally. Each submission is graded inside `try/except BaseException` under a
  watchdog: a failure of the grader itself is a row "grader error: ..." and the run goes on; a sandbox that
  cannot start is tried again once. Rows are appended to the CSV as they are graded.
* Besides the public cases of the check cells, every task is graded on extra cases drawn from `--seed`
  (`checks.extra_cases`; default: a random one, written to OUT.seed).

The CLI pieces are `add_parser(subparsers)` and `run(args) -> int`; `main(argv)` runs them standalone.
"""

from __future__ import annotations

import argparse
import ast
import copy
import csv
import hashlib
import json
import os
import re
import select
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CELL_TIMEOUT = 120          # seconds one cell may run before it is interrupted
DEFAULT_WALL_TIMEOUT = 900          # seconds the whole notebook may run (kernel start included)
LOG_CAP = 64 * 1024                 # bytes of what a notebook prints kept for diagnostics
OUTPUT_LIMIT = 16 * 2**20           # bytes a notebook may print before its worker is stopped
MAX_EVENT = 64 * 1024               # bytes of one protocol event from the worker (a cell ran, a task is ready)
MIN_REPLY_CAP = 2**20               # bytes of one answer to a case: this, or 4x the task's largest expected answer
MAX_NOTE = 1500                     # characters of a failing case's message kept as its task's note
GRACE = 5.0                         # seconds the grader waits past a deadline the worker enforces itself
CHECK_CALL = re.compile(r"checks\s*\.\s*(ex\d\d)_(\w+)\s*\(")
CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|[\x00-\x09\x0b-\x1f\x7f-\x9f]")
WATCHDOG_MARGIN = 60.0              # seconds past its wall-clock limit before a submission's grading is abandoned


def clean(text: str) -> str:
    """Text of a note or a CSV cell without terminal escapes or control characters (newlines stay)."""
    return CONTROL.sub("", str(text))


def default_solutions_dir() -> Path:
    """`solutions/` next to the package (a source checkout, as the instructor has)."""
    return Path(__file__).resolve().parent.parent.parent / "solutions"


def normalize_source(source: str) -> str:
    """Source as compared: trailing whitespace of each line and surrounding blank lines removed."""
    return "\n".join(line.rstrip() for line in source.strip("\n").split("\n")).strip("\n")


def source_checksum(source: str) -> str:
    return hashlib.sha256(normalize_source(source).encode()).hexdigest()


@dataclass
class TaskSpec:
    """One graded task as the solution notebook defines it."""

    task: str                      # "ex03.slot_mapping"
    points: float
    exercise: str                  # "ex03"
    checksum: str                  # of the check cell's source
    source: str
    outputs: list = field(default_factory=list)   # the expected (PASS) outputs of the check cell


def load_specs(solutions_dir: str | os.PathLike | None = None) -> dict[str, list[TaskSpec]]:
    """Tasks per exercise ("ex03" -> [TaskSpec, ...] in notebook order), read from the solution notebooks."""
    import nbformat

    root = Path(solutions_dir) if solutions_dir is not None else default_solutions_dir()
    paths = sorted(root.glob("ex[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"solutions: no exNN_*.ipynb in {str(root)!r}; pass --solutions DIR")
    specs: dict[str, list[TaskSpec]] = {}
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            meta = cell.metadata.get("minirt", {}) if cell.cell_type == "code" else {}
            if "task" in meta:
                task = meta["task"]
                spec = TaskSpec(task, float(meta.get("points", 1)), task.split(".")[0],
                                source_checksum(cell.source), cell.source, copy.deepcopy(cell.outputs))
                specs.setdefault(spec.exercise, []).append(spec)
    return specs


def _task_of(cell) -> str | None:
    """The task a code cell checks: from its metadata, else from a `checks.exNN_name(` call."""
    meta = cell.metadata.get("minirt", {})
    if isinstance(meta, dict) and isinstance(meta.get("task"), str):
        return meta["task"]
    m = CHECK_CALL.search(cell.source)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _exercise_of(nb, path: Path, specs: dict[str, list[TaskSpec]]) -> str | None:
    found = [t.split(".")[0] for c in nb.cells if c.cell_type == "code" and (t := _task_of(c))]
    found = [e for e in found if e in specs]
    if found:
        return max(set(found), key=found.count)
    m = re.search(r"ex(\d\d)", path.name)
    return f"ex{m.group(1)}" if m and f"ex{m.group(1)}" in specs else None


def prepare(nb, specs: list[TaskSpec]):
    """Make the notebook to run: returns (notebook, {nbval cell number: task}, {task: problem}).

    Check cells that match the solution get the solution's expected outputs; every other code cell has
    its outputs cleared and is not compared. Edited or missing check cells are reported as problems.
    """
    nb = copy.deepcopy(nb)
    by_task = {s.task: s for s in specs}
    cell_of_task: dict[int, str] = {}
    problems: dict[str, str] = {}
    seen: set[str] = set()
    code_index = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        task = _task_of(cell)
        cell.outputs = []
        cell.execution_count = None
        if task in by_task and task not in seen:
            seen.add(task)
            spec = by_task[task]
            if source_checksum(cell.source) != spec.checksum:
                problems[task] = "check cell edited (its source differs from the original)"
            else:
                cell.outputs = copy.deepcopy(spec.outputs)
                cell.execution_count = 1
                cell_of_task[code_index] = task
        code_index += 1
    for spec in specs:
        if spec.task not in seen:
            problems[spec.task] = "check cell missing"
    return nb, cell_of_task, problems


# ------------------------------------------------------------------------------------ the worker


def _check_arg(source: str) -> str | None:
    """The argument of the check call in a (trusted) check cell: `checks.ex03_slot_mapping(slot_mapping)`
    -> "slot_mapping", the expression the worker evaluates to take the task's function or class."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and CHECK_CALL.match(ast.unparse(node.func) + "("):
            return ast.unparse(node.args[0])
    return None


def make_plan(nb, specs: list[TaskSpec], cell_timeout: float):
    """(the worker's plan, {task: problem}, the sources of the non-check code cells). The plan lists every
    code cell in order: its source, or, for a check cell that matches the solution, its task and argument."""
    _, cell_of_task, problems = prepare(nb, specs)
    by_task = {s.task: s for s in specs}
    cells, sources = [], []
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    where = cell_places(nb)
    for index, cell in enumerate(code_cells):
        task = cell_of_task.get(index)
        if task is not None:
            arg = _check_arg(by_task[task].source)
            if arg is None:
                problems[task] = "the solution's check cell has no check call"
                continue
            cells.append({"task": task, "arg": arg})
        else:
            cells.append({"source": cell.source, "where": where[index]})
            sources.append(cell.source)
    return {"cell_timeout": cell_timeout, "cells": cells}, problems, sources


def cell_places(nb) -> list[str]:
    """For each code cell, where a student finds it: "cell 7 (under 'Task 2 — the naive loop')", counting every
    cell from 1 as JupyterLab shows them, with the nearest markdown heading above it. (nbval's "Cell N"
    counts code cells only, from 0.)"""
    places, heading = [], None
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "markdown":
            found = [ln.lstrip("#").strip() for ln in cell.source.split("\n") if re.match(r"#{1,6}\s", ln)]
            heading = found[-1] if found else heading
        elif cell.cell_type == "code":
            places.append(f"cell {number}" + (f" (under '{heading[:60]}')" if heading else ""))
    return places


class Expectations:
    """The reference's outcome and the encoded inputs of every case of a task, computed once in the grader's
    process and shared by all submissions (and threads); with each task the cap on one answer's size (bytes):
    `MIN_REPLY_CAP`, or four times the task's largest expected answer when that is more."""

    def __init__(self, seed: int | None = None):
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple] = {}
        self.seed = seed                  # of the seeded extra cases (`checks.EXTRA_CASES`); None: public cases only

    def get(self, task: str):
        from minirt.course import checks, wire

        with self._lock:
            if task not in self._tasks:
                spec = checks.SPECS[task]()
                cases = spec.cases + (checks.extra_cases(task, self.seed, spec) if self.seed is not None else [])
                with checks._quiet(), torch_fork_rng():
                    rows = [(case, checks.reference_outcome(spec, case), wire.encode(case.make()))
                            for case in cases]
                largest = max([len(wire.dumps(wire.encode(e[1]))) for _, e, _ in rows if e[0] == "ok"] or [0])
                self._tasks[task] = (spec, rows, max(MIN_REPLY_CAP, 4 * largest))
            return self._tasks[task]


def torch_fork_rng():
    import torch

    return torch.random.fork_rng(devices=[])


class Connection:
    """Reads the worker's protocol messages with a deadline; drains and caps its other output."""

    def __init__(self, worker, output_limit: int):
        self.worker, self.output_limit = worker, output_limit
        self.fd = worker.proc.stdout.fileno()
        self.buf = b""
        self.log = bytearray()
        self.printed = 0
        self.flooded = False
        self.broken: str | None = None
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self) -> None:
        f = self.worker.proc.stderr
        while True:
            try:
                chunk = f.read1(1 << 16)
            except (OSError, ValueError):
                return
            if not chunk:
                return
            self.printed += len(chunk)
            if len(self.log) < LOG_CAP:
                self.log += chunk[:LOG_CAP - len(self.log)]
            if self.printed > self.output_limit and not self.flooded:
                self.flooded = True
                self.worker.kill()

    def send(self, msg: dict) -> bool:
        from minirt.course import wire

        try:
            self.worker.proc.stdin.write(wire.dumps(msg))
            self.worker.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def recv(self, deadline: float, limit: int = MAX_EVENT) -> dict | None:
        """The next message (at most `limit` bytes); None when the worker is gone, stops talking by `deadline`,
        or breaks the protocol (`self.broken` says which: a message too long, too deep, or not a JSON object)."""
        from minirt.course import wire

        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = "timeout"
                return None
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                self.broken = "output limit" if self.flooded else "died"
                return None
            self.buf += chunk
            if len(self.buf) > limit and b"\n" not in self.buf[:limit + 1]:
                self.broken = "too long"
                return None
        line, self.buf = self.buf.split(b"\n", 1)
        if len(line) > limit:
            self.broken = "too long"
            return None
        try:
            msg = wire.parse(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            self.broken = "protocol"
            return None
        return msg


def _is_text(x, limit: int = 1 << 20) -> bool:
    return isinstance(x, str) and len(x) <= limit


def valid_event(msg: dict) -> bool:
    """Whether a worker's event has exactly the fields and types of the protocol (`minirt.course.worker`)."""
    event = msg.get("event")
    if event in ("done", "ready"):
        return set(msg) == {"event"}
    if event == "cell":
        return set(msg) == {"event", "index", "error"} and type(msg["index"]) is int and \
            (msg["error"] is None or _is_text(msg["error"], 4000))
    if event == "task":
        return set(msg) == {"event", "task", "error", "identity"} and _is_text(msg["task"], 200) and \
            (msg["error"] is None or _is_text(msg["error"], 4000)) and \
            (msg["identity"] is None or isinstance(msg["identity"], dict))
    return False


REPLY_FIELDS = {"ok": {"kind", "value", "printed"}, "raised": {"kind", "type", "mro", "message", "printed"},
                "not_implemented": {"kind"}, "timeout": {"kind"}, "blocked": {"kind", "printed"}}


def _outcome_of(reply: dict):
    """(kind, value, printed) from a worker's reply to a case; ValueError when it does not follow the protocol
    (its fields and their types exactly; the value as `wire.decode` accepts it)."""
    from minirt.course import checks

    kind = reply.get("kind")
    if not isinstance(kind, str) or REPLY_FIELDS.get(kind) != set(reply):
        raise ValueError(f"unexpected reply (kind {str(kind)[:40]!r}, fields {sorted(map(str, reply))[:6]})")
    printed = reply.get("printed", "")
    if not _is_text(printed):
        raise ValueError("printed is not text")
    printed = clean(printed[:2000])
    if kind == "ok":
        return "ok", reply["value"], printed           # decoded by the caller: a bad value is a wrong answer
    if kind == "raised":
        mro = reply["mro"]
        if not (_is_text(reply["type"], 1000) and _is_text(reply["message"]) and isinstance(mro, list)
                and len(mro) <= 100 and all(_is_text(m, 1000) for m in mro)):
            raise ValueError("malformed exception report")
        return "raised", checks.RemoteError(clean(reply["type"][:200]), mro[:50],
                                            clean(reply["message"][:checks.MAX_REPR])), printed
    return kind, None, printed


def _case_note(message: str, limit: int = MAX_NOTE) -> str:
    """A failing case's message as the note of its task: the case, its inputs, expected and got (the same
    text the check cell shows in the notebook), cut at `limit` characters."""
    text = message.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _judge_task(conn: Connection, task: str, expectations: Expectations, timeout: float) -> tuple[bool, str | None]:
    """Send every case of `task` to the worker and compare its answers here: (passed, note). A note of None means
    the worker is gone or broke the protocol (`conn.broken` says which)."""
    from minirt.course import checks, wire

    _, rows, cap = expectations.get(task)
    n = len(rows)
    deadline = time.monotonic() + timeout
    for i, (case, expected, inputs) in enumerate(rows, 1):
        left = deadline - time.monotonic()
        if left <= 0 or not conn.send({"op": "case", "inputs": inputs, "time_left": left}):
            return False, f"timed out (a cell ran over {timeout:g} s)" if left <= 0 else None
        reply = conn.recv(deadline + GRACE, limit=cap)
        if reply is None:
            return False, None
        try:
            kind, value, printed = _outcome_of(reply)
        except (ValueError, TypeError, RuntimeError, OverflowError, MemoryError):
            conn.broken = "protocol"
            return False, None
        if kind == "not_implemented":
            return False, "task not implemented yet"
        if kind == "timeout":
            return False, f"timed out (a cell ran over {timeout:g} s)"
        if kind == "ok":
            try:
                value = wire.decode(value, device=checks.device())
            except (ValueError, TypeError, RuntimeError, OverflowError) as e:
                return False, (f"{task} failed on case {i}/{n} '{case.name}': your function's answer could not be "
                               f"read ({clean(str(e))[:120]})")
        if kind == "blocked":
            return False, (f"calls minirt's own implementation while grading ({_ref_names(task)}): not a solution "
                           f"(case {i}/{n} '{case.name}')")
        try:
            message = checks.compare(task, i, case, n, expected, (kind, value), printed)
        except Exception as e:  # noqa: BLE001 - an answer the comparison cannot read is a wrong answer
            message = f"{task} failed on case {i}/{n} '{case.name}': the answer could not be compared ({type(e).__name__})"
        if message is not None:
            return False, _case_note(message)
    return True, None


def _ref_names(task: str) -> str:
    from minirt.course import checks

    return ", ".join(n.replace(":", ".") for n in checks.REFERENCE_NAMES.get(task, ()))


#: A broken connection's reason (`conn.broken`) as the run's status.
BROKEN_STATUS = {"died": "worker died", "timeout": "worker stopped answering", "output limit": "output limit",
                 "protocol": "protocol broken", "too long": "protocol broken"}
BROKEN_NOTES = {
    "died": "kernel died (the notebook could not go on)",
    "timeout": "timed out: the worker stopped answering and was killed",
    "output limit": "output limit: the notebook printed more than {limit} MB and was stopped",
    "protocol": "the worker broke the grading protocol and was stopped",
    "too long": "the worker's answer was longer than the grader reads and the worker was stopped",
}


@dataclass
class RunResult:
    scores: dict[str, float]
    notes: dict[str, str]
    status: str                         # "finished", "wall timeout", "worker died", ...
    seconds: float
    log: str                            # the head of what the notebook printed
    warnings: list[str] = field(default_factory=list)   # the screen's hints for the instructor (no lost points)


def run_submission(nb, task_specs: list[TaskSpec], expectations: Expectations, sandbox: str, slot: int = 0,
                   cell_timeout: float = DEFAULT_CELL_TIMEOUT, wall_timeout: float = DEFAULT_WALL_TIMEOUT,
                   limits=None, output_limit: int = OUTPUT_LIMIT, holder: dict | None = None) -> RunResult:
    """Run one submission in a sandboxed worker and score its tasks in this process. `holder["worker"]` is set to
    the worker while it runs (the grader's watchdog kills it there)."""

    from minirt.course import provenance
    from minirt.course.sandbox import Limits

    start = time.monotonic()
    plan, problems, sources = make_plan(nb, task_specs, cell_timeout)
    scores = {s.task: 0.0 for s in task_specs}
    notes: dict[str, str] = dict(problems)
    for s in task_specs:                      # the references' modules, by their trusted names, before the screen
        provenance.reference_objects(s.task)
    tamper, warnings = provenance.screen(sources)
    for s in task_specs:
        if s.task not in notes and tamper:
            notes[s.task] = tamper
        if s.task not in notes:
            arg = _check_arg(s.source)
            found = provenance.scan(sources, s.task, arg if arg and arg.isidentifier() else None)
            if found:
                notes[s.task] = found
    last = None
    for attempt in range(START_ATTEMPTS):         # the sandbox failing to start is the grader's fault: try again
        try:
            return _run_worker(plan, task_specs, expectations, sandbox, slot, cell_timeout, wall_timeout,
                               limits or Limits(), output_limit, holder, start, scores, notes, warnings)
        except InfrastructureError as e:
            last = e
            time.sleep(1.0 + attempt)
    for s in task_specs:
        notes.setdefault(s.task, "not run: the grader's sandbox failed (not your fault; grade it again)")
    return RunResult(scores, notes, f"grader error: the worker could not start ({str(last)[:200]})",
                     time.monotonic() - start, "", warnings)


class InfrastructureError(Exception):
    """The worker could not start, or died before it was ready (before any of the submission's code ran)."""


START_ATTEMPTS = 2


def _run_worker(plan, task_specs, expectations, sandbox, slot, cell_timeout, wall_timeout, limits, output_limit,
                holder, start, scores, notes, warnings) -> RunResult:
    from minirt.course import provenance
    from minirt.course.sandbox import Worker

    notes, scores = dict(notes), dict(scores)
    points = {s.task: s.points for s in task_specs}
    try:
        worker = Worker(sandbox, slot, limits, json.dumps(plan).encode())
    except OSError as e:                          # ENOSPC, EMFILE, ... on the grader's side
        raise InfrastructureError(f"{type(e).__name__}: {e}") from None
    if holder is not None:
        holder["worker"] = worker
    conn = Connection(worker, output_limit)
    wall = start + wall_timeout
    status = "finished"
    reached: set[str] = set()
    cell_error = None                                           # the last failed cell since the last check
    ready = False
    try:
        while True:
            msg = conn.recv(min(wall, time.monotonic() + cell_timeout + GRACE))
            if msg is None and not ready and conn.broken in ("died", "timeout"):
                raise InfrastructureError(bytes(conn.log[-300:]).decode("utf-8", "replace").strip() or conn.broken)
            if msg is None:
                status = ("wall timeout" if time.monotonic() >= wall else
                          BROKEN_STATUS.get(conn.broken or "", "worker died"))
                break
            if not valid_event(msg):
                status = "protocol broken"
                break
            event = msg.get("event")
            if event == "ready":
                ready = True
                continue
            if not ready:
                status = "protocol broken"
                break
            if event == "done":
                break
            if event == "cell":
                if msg.get("error"):
                    index = msg.get("index")
                    place = plan["cells"][index].get("where", "") if isinstance(index, int) and \
                        0 <= index < len(plan["cells"]) else ""
                    cell_error = (place, str(msg["error"]))
                continue
            if event != "task":
                continue
            task = msg.get("task")
            if task not in points or task in reached:
                status = "protocol broken"
                break
            reached.add(task)
            if task in notes:                                   # edited, or minirt's own: no cases run
                pass
            elif msg.get("error"):
                place, error = cell_error or ("", "")
                why = "timeout" if "timeout" in (msg["error"], error) else (f"{place}: {error}" if place else error)
                notes[task] = (f"timed out (a cell ran over {cell_timeout:g} s)" if why == "timeout" else
                               f"the task's function could not be taken: {str(msg['error'])[:150]}"
                               + (f" (a cell before failed: {why[:200]})" if why else ""))
            else:
                found = provenance.judge_identity(msg.get("identity"), task)   # the worker's word: a hint only
                if found and found not in warnings:
                    warnings.append(found)
                ok, note = _judge_task(conn, task, expectations, min(cell_timeout, max(0.0, wall - time.monotonic())))
                if ok:
                    scores[task] = points[task]
                elif note is None:
                    reached.discard(task)                       # the worker is gone: said below
                    break_reason = conn.broken or "died"
                    notes[task] = BROKEN_NOTES.get(break_reason, BROKEN_NOTES["died"]).format(
                        limit=output_limit // 2**20)
                    status = BROKEN_STATUS.get(break_reason, "worker died")
                    break
                else:
                    notes[task] = note
            cell_error = None
            conn.send({"op": "next"})
    finally:
        worker.cleanup()
    for s in task_specs:
        if s.task not in reached and s.task not in notes:
            if status == "wall timeout":
                notes[s.task] = f"not run: the notebook hit the wall-clock limit of {wall_timeout:g} s"
            elif status == "output limit":
                notes[s.task] = BROKEN_NOTES["output limit"].format(limit=output_limit // 2**20)
            elif status in ("worker died", "protocol broken", "worker stopped answering"):
                notes[s.task] = BROKEN_NOTES["died"] if status == "worker died" else f"not run ({status})"
            else:
                notes[s.task] = "not run (the notebook ended before its check cell)"
    return RunResult(scores, notes, status, time.monotonic() - start, bytes(conn.log).decode("utf-8", "replace"),
                     warnings)


# ------------------------------------------------------------------------------------ grading


def grade(paths, out_csv: str | os.PathLike | None = None, timeout: float = DEFAULT_CELL_TIMEOUT,
          wall_timeout: float = DEFAULT_WALL_TIMEOUT, solutions_dir: str | os.PathLike | None = None,
          verbose: bool = True, sandbox: str = "auto", jobs: int = 1, limits=None,
          seed: int | None = None) -> list[dict]:
    """Grade each submission; returns one row per submission and writes `out_csv` when given.

    A row: {"submission", "exercise", "scores": {task: points}, "total", "max", "notes": {task: reason},
    "seconds", "status", "sandbox"}. `timeout` is per cell (and per task's check), `wall_timeout` per
    notebook (seconds). `sandbox` is auto, bwrap, user or none (see `minirt.course.sandbox`); `jobs`
    submissions run at a time. `seed` draws the grader's extra cases (`checks.EXTRA_CASES`; None: the public
    cases only); it is written beside the CSV as `<out>.seed`.
    """
    from concurrent.futures import ThreadPoolExecutor

    from minirt.course import sandbox as sandboxes

    specs = load_specs(solutions_dir)
    kind = sandboxes.resolve(sandbox)
    if verbose and kind != "bwrap":
        print(f"warning: grading with sandbox {kind!r}: " + (
            "an unprivileged user with resource limits; the file system is not hidden from submissions"
            if kind == "user" else "no isolation at all, resource limits only"), file=sys.stderr, flush=True)
    expectations = Expectations(seed)
    paths = [Path(p) for p in paths]
    if out_csv is not None and seed is not None:
        Path(f"{out_csv}.seed").write_text(f"{seed}\n")
    slots = list(range(max(1, min(int(jobs), sandboxes.MAX_SLOTS))))
    free, spare = list(slots), list(range(len(slots), sandboxes.MAX_SLOTS))
    lock = threading.Lock()
    sink = CsvSink(out_csv, _columns_of(paths, specs), specs) if out_csv is not None else None
    limit = wall_timeout + WATCHDOG_MARGIN
    _import_references(specs)

    def one(path: Path) -> dict:
        with lock:
            slot = free.pop() if free else (spare.pop() if spare else slots[0])
        holder: dict = {}
        box: dict = {}

        def work() -> None:
            first = None
            for _ in range(2):          # the grader's own failure is never the student's: graded once more
                try:
                    box["row"] = _grade_one(path, specs, expectations, kind, slot, timeout, wall_timeout, limits,
                                            holder)
                except BaseException as e:  # noqa: BLE001 - the grader's own failure: this row only, never the run
                    why = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"grader error on {path}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                    box["row"] = _error_row(path, specs, kind, f"grader error: {why}")
                    if first is None:
                        first = why
                        continue
                if first is not None:
                    row = box["row"]
                    row["warnings"] = "; ".join(w for w in (row.get("warnings"), f"graded twice: the first run "
                                                            f"failed in the grader ({first})") if w)
                return

        thread = threading.Thread(target=work, name=f"grade {path.name}", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():                    # the watchdog: stop the worker, then give up on this one
            worker = holder.get("worker")
            if worker is not None:
                worker.kill()
            thread.join(5)
        stuck = thread.is_alive()
        with lock:
            if not stuck:
                free.append(slot)
        row = box.get("row") if not stuck else None
        if row is None:
            row = _error_row(path, specs, kind, f"grader error: grading ran past {limit:g} s and was abandoned")
        row = _cleaned(row)
        if sink is not None:
            sink.add(row)
        _progress(verbose, row)
        return row

    if len(slots) == 1:
        rows = [one(p) for p in paths]
    else:
        with ThreadPoolExecutor(len(slots)) as pool:
            rows = list(pool.map(one, paths))
    if sink is not None:
        sink.finish(rows)
    return rows


def _import_references(specs) -> None:
    """Import every graded task's reference module in this thread, before the grading threads start: two threads
    importing the same modules for the first time can see one half-initialised (Python's import locks are per
    module), and that would fail a submission for a reason that is the grader's."""
    from minirt.course import checks, provenance

    for task_specs in specs.values():
        for s in task_specs:
            if s.task in checks.SPECS:
                provenance.reference_objects(s.task)


def _error_row(path: Path, specs, kind: str, status: str) -> dict:
    """The row of a submission the grader could not grade: 0 on its exercise's tasks (from its file name)."""
    import nbformat

    row = {"submission": str(path), "exercise": None, "scores": {}, "total": 0.0, "max": 0.0,
           "notes": {}, "seconds": 0.0, "status": status, "sandbox": kind}
    try:
        exercise = _exercise_of(nbformat.v4.new_notebook(), path, specs)
    except Exception:  # noqa: BLE001
        exercise = None
    if exercise is not None:
        row["exercise"], row["max"] = exercise, sum(s.points for s in specs[exercise])
        row["scores"] = {s.task: 0.0 for s in specs[exercise]}
    return row


def _cleaned(row: dict) -> dict:
    row = dict(row)
    row["submission"], row["status"] = clean(row["submission"]), clean(row["status"])
    row["notes"] = {t: clean(n) for t, n in row["notes"].items()}
    if "warnings" in row:
        row["warnings"] = clean(row["warnings"])
    return row


def _columns_of(paths: list[Path], specs) -> list[str]:
    """The task columns of a grade sheet: every task of each exercise the submissions are of."""
    import nbformat

    exercises = set()
    for p in paths:
        try:
            nb = nbformat.read(p, as_version=4)
        except Exception:  # noqa: BLE001 - unreadable: its exercise from its file name
            nb = nbformat.v4.new_notebook()
        try:
            exercises.add(_exercise_of(nb, p, specs))
        except Exception:  # noqa: BLE001
            pass
    return [s.task for e in sorted(x for x in exercises if x) for s in specs[e]]


class CsvSink:
    """The grade sheet, written as the grading goes: the header first, each row appended (and flushed) as soon
    as its submission is graded, so a run that is stopped keeps every row graded so far. `finish` rewrites it
    in the order the submissions were given."""

    def __init__(self, path, tasks: list[str], specs):
        self.path, self.tasks, self.specs = Path(path), tasks, specs
        self._lock = threading.Lock()
        self.f = open(self.path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(_header(tasks))
        self.f.flush()

    def add(self, row: dict) -> None:
        with self._lock:
            self.w.writerow(_csv_row(row, self.tasks))
            self.f.flush()

    def finish(self, rows: list[dict]) -> None:
        self.f.close()
        write_csv(rows, self.path, self.specs, self.tasks)


def _grade_one(path: Path, specs, expectations, kind, slot, timeout, wall_timeout, limits, holder=None) -> dict:
    import nbformat

    row = {"submission": str(path), "exercise": None, "scores": {}, "total": 0.0, "max": 0.0,
           "notes": {}, "seconds": 0.0, "status": "", "sandbox": kind}
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001 - unreadable file: no points, say why
        row["status"] = f"unreadable notebook: {type(e).__name__}: {str(e)[:200]}"
        exercise = _exercise_of(nbformat.v4.new_notebook(), path, specs)   # from the file name, if it says
        if exercise is not None:
            row["exercise"], row["max"] = exercise, sum(s.points for s in specs[exercise])
            row["scores"] = {s.task: 0.0 for s in specs[exercise]}
        return row
    exercise = _exercise_of(nb, path, specs)
    if exercise is None:
        row["status"] = "no exercise recognised (no check cells, no exNN in the file name)"
        return row
    row["exercise"] = exercise
    task_specs = specs[exercise]
    row["max"] = sum(s.points for s in task_specs)
    result = run_submission(nb, task_specs, expectations, kind, slot, timeout, wall_timeout, limits, holder=holder)
    row["seconds"], row["status"] = result.seconds, result.status
    row["scores"], row["notes"] = result.scores, {t: result.notes[t] for t in result.scores if t in result.notes}
    row["total"] = sum(row["scores"].values())
    row["warnings"] = "; ".join(result.warnings)
    return row


def _progress(verbose: bool, row: dict) -> None:
    if verbose:
        print(f"graded {row['submission']}: {row['total']:g}/{row['max']:g} "
              f"({row['seconds']:.1f} s{', ' + row['status'] if row['status'] not in ('', 'finished') else ''})",
              file=sys.stderr, flush=True)


def _columns(rows: list[dict], specs: dict[str, list[TaskSpec]]) -> list[str]:
    exercises = sorted({r["exercise"] for r in rows if r["exercise"]})
    return [s.task for e in exercises for s in specs[e]]


def _header(tasks: list[str]) -> list[str]:
    return ["submission", "exercise", *tasks, "total", "max", "sandbox", "notes", "warnings"]


def _csv_row(r: dict, tasks: list[str]) -> list[str]:
    notes = "; ".join(f"{t}: {n}" for t, n in r["notes"].items())
    if r["status"] not in ("", "finished"):
        notes = f"{r['status']}" + (f"; {notes}" if notes else "")
    cells = [r["submission"], r["exercise"] or "", *[(f"{r['scores'][t]:g}" if t in r["scores"] else "") for t in tasks],
             f"{r['total']:g}", f"{r['max']:g}", r.get("sandbox", ""), notes, r.get("warnings", "")]
    return [clean(c) for c in cells]


def write_csv(rows: list[dict], out_csv, specs: dict[str, list[TaskSpec]] | None = None,
              tasks: list[str] | None = None) -> None:
    """One row per submission: submission, exercise, one column per task, total, max, sandbox, notes, warnings.
    Written to a temporary file beside `out_csv`, then moved over it."""
    specs = specs or {}
    if tasks is None:
        tasks = _columns(rows, specs) if specs else sorted({t for r in rows for t in r["scores"]})
    tmp = Path(f"{out_csv}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_header(tasks))
        for r in rows:
            w.writerow(_csv_row(r, tasks))
    os.replace(tmp, out_csv)


def format_table(rows: list[dict], specs: dict[str, list[TaskSpec]]) -> str:
    """The grade sheet as text: a line per submission, a column per task, then the notes."""
    tasks = _columns(rows, specs)
    header = ["submission", *tasks, "total"]
    body = []
    for r in rows:
        cells = [Path(r["submission"]).name]
        for t in tasks:
            pts = next((s.points for e in specs.values() for s in e if s.task == t), 0)
            cells.append(f"{r['scores'][t]:g}/{pts:g}" if t in r["scores"] else "")
        cells.append(f"{r['total']:g}/{r['max']:g}")
        body.append(cells)
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *body]]
    notes = []
    for r in rows:
        name = Path(r["submission"]).name
        if r["status"] not in ("", "finished"):
            notes.append(f"  {name}: {r['status']}")
        notes += [f"  {name} {t}: " + n.replace("\n", "\n      ") for t, n in r["notes"].items()]
        if r.get("warnings"):
            notes.append(f"  {name} (warning, no points lost): {r['warnings']}")
    kinds = sorted({r.get("sandbox") for r in rows if r.get("sandbox")})
    footer = [f"sandbox: {', '.join(kinds)}"] if kinds else []
    return clean("\n".join(lines + (["", "notes:", *notes] if notes else []) + footer))


# ------------------------------------------------------------------------------------ command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `grade` subcommand to an argparse subparsers object (`python -m minirt grade ...`)."""
    p = subparsers.add_parser("grade", help="grade exercise notebooks (each in a sandboxed worker; writes a CSV)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("submissions", nargs="+", help="submitted .ipynb files")
    p.add_argument("--out", default=None, help="write the grade sheet to this CSV file")
    p.add_argument("--timeout", type=float, default=DEFAULT_CELL_TIMEOUT,
                   help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    p.add_argument("--wall-timeout", type=float, default=DEFAULT_WALL_TIMEOUT,
                   help=f"seconds one whole notebook may run (default {DEFAULT_WALL_TIMEOUT})")
    p.add_argument("--solutions", default=None,
                   help="directory of the solution notebooks (default: solutions/ of this checkout)")
    p.add_argument("--sandbox", choices=["auto", "bwrap", "user", "none"], default="auto",
                   help="where submissions run: bwrap (bubblewrap), user (an unprivileged uid), none; "
                        "auto (default) takes the first that works")
    p.add_argument("--jobs", type=int, default=1, help="submissions graded at a time (default 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the grader's extra cases, which students do not have (default: a fresh random one, "
                        "printed and written to OUT.seed)")
    return p


def run(args) -> int:
    """Run the `grade` subcommand. Exit status 0 once every submission is graded, 2 on bad arguments."""
    try:
        specs = load_specs(args.solutions)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [s for s in args.submissions if not Path(s).is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    from minirt.course import sandbox

    try:
        sandbox.resolve(getattr(args, "sandbox", "auto"))
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seed = getattr(args, "seed", None)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rows = grade(args.submissions, args.out, args.timeout, args.wall_timeout, args.solutions,
                 sandbox=getattr(args, "sandbox", "auto"), jobs=getattr(args, "jobs", 1), seed=seed)
    print(format_table(rows, specs))
    print(f"seed of the extra cases: {seed}" + (f" (in {args.out}.seed)" if args.out else ""))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirt.course.grading")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(["grade", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
