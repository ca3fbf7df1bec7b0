"""Grade submitted exercise notebooks: `python -m minirt grade SUBMISSIONS... [--out grades.csv]`.

Each submission is run on its own, top to bottom, under nbval (`python -m pytest --nbval`) in a temporary
copy, in a fresh kernel of this Python, with a per-cell timeout and a wall-clock limit for the whole run.
A task scores its points when its check cell passes, that is when the cell runs without an exception and
prints exactly the `PASS exNN.task (k/k cases)` line of the solution notebook.

What the grader trusts is the solutions directory (`solutions/` of the repository, or `--solutions DIR`):
the tasks, their points, the source of every check cell and its expected output come from there.

* A check cell is found by its metadata (`{"minirt": {"task": "ex03.slot_mapping", "points": 1}}`) or by
  the `checks.ex03_slot_mapping(` call in its source. If its source differs from the solution's (compared
  by a SHA-256 of the source with trailing whitespace removed), the task scores 0: "check cell edited".
  A missing check cell scores 0 as well.
* Outputs stored in the submission are ignored: before the run, every check cell gets the solution's
  expected output and every other cell's outputs are cleared (so a student's own prints never fail a cell).
* A submission that raises, hangs (the cell is interrupted after `--timeout` seconds), kills its kernel
  (the cells after it cannot run and score 0), or floods its output (only the first bytes of anything it
  prints are read) loses only its own points; the other submissions are graded normally.

This is a grader for honest mistakes, not a sandbox: a submission runs arbitrary code as the user who
grades. Grade untrusted submissions in a container or as an unprivileged user.

The CLI pieces are `add_parser(subparsers)` and `run(args) -> int`; `main(argv)` runs them standalone.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CELL_TIMEOUT = 120          # seconds one cell may run before it is interrupted
DEFAULT_WALL_TIMEOUT = 900          # seconds the whole notebook may run (kernel start included)
LOG_CAP = 64 * 1024                 # bytes of pytest's own output kept for diagnostics
MESSAGE_CAP = 4000                  # characters of one cell's failure report kept
CHECK_CALL = re.compile(r"checks\s*\.\s*(ex\d\d)_(\w+)\s*\(")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


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


# ------------------------------------------------------------------------------------ running nbval

# Written next to the notebook as conftest.py: reports every cell's outcome, as it happens, to a file the
# kernel is not told about, and fails a cell at once when the kernel dies (nbval would wait out the timeout).
_PLUGIN = r'''
import json, os, re, time

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RESULTS = os.environ.pop("MINIRT_GRADE_RESULTS", None)


def pytest_configure(config):
    try:
        from queue import Empty
        from nbval.kernel import RunningKernel
    except Exception:
        return
    original = RunningKernel.await_reply

    def await_reply(self, msg_id, timeout=None):
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                raise Empty
            try:
                return original(self, msg_id, timeout=left)
            except Empty:
                if not self.is_alive():
                    raise RuntimeError("Kernel died while executing the cell") from None

    RunningKernel.await_reply = await_reply


def pytest_runtest_logreport(report):
    if _RESULTS is None or not (report.when == "call" or report.outcome != "passed"):
        return
    text = "" if report.passed else _ANSI.sub("", str(report.longrepr))
    if len(text) > %(cap)d:          # the exception line is at the end: keep both ends
        text = text[:1000] + "\n[...]\n" + text[-(%(cap)d - 1000):]
    with open(_RESULTS, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "message": text}) + "\n")
''' % {"cap": MESSAGE_CAP}


@dataclass
class RunResult:
    cells: dict[int, tuple[str, str]]       # nbval cell number -> (outcome, message)
    status: str                              # "finished", "wall timeout", "could not start"
    seconds: float
    log: str                                 # the head of pytest's own output


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill pytest and every process it started (the kernel runs in a session of its own)."""
    victims = []
    try:
        import psutil

        victims = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in victims:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    proc.wait()


def run_notebook(path: Path, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                 wall_timeout: float = DEFAULT_WALL_TIMEOUT) -> RunResult:
    """Run one notebook under nbval in a scratch directory; every cell's outcome, however the run ends."""
    work = Path(tempfile.mkdtemp(prefix="minirt-grade-"))
    private = Path(tempfile.mkdtemp(prefix="minirt-grade-results-"))
    results = private / "results.jsonl"
    start = time.monotonic()
    try:
        nb_path = work / "submission.ipynb"
        shutil.copyfile(path, nb_path)
        (work / "conftest.py").write_text(_PLUGIN)
        (work / "pytest.ini").write_text("[pytest]\naddopts =\n")
        env = dict(os.environ, MINIRT_GRADE_RESULTS=str(results), MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", nb_path.name,
               "--nbval-cell-timeout", str(cell_timeout), "--nbval-kernel-startup-timeout", "120",
               "-c", "pytest.ini", "--rootdir", str(work), "-p", "no:cacheprovider", "-q", "--tb=no",
               "-W", "ignore", "--color=no"]
        log_path = private / "pytest.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                proc.wait(timeout=wall_timeout)
                status = "finished"
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                status = "wall timeout"
            else:
                _kill_tree(proc)      # a kernel left behind (it should not be) goes too
        with open(log_path, "rb") as f:
            head = f.read(LOG_CAP).decode("utf-8", "replace")
        cells: dict[int, tuple[str, str]] = {}
        if results.exists():
            with open(results, "rb") as f:
                for raw in f.read(8 * 2**20).splitlines():
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        continue
                    m = re.search(r"::Cell (\d+)$", rec.get("nodeid", ""))
                    if m:
                        n = int(m.group(1))
                        if n not in cells or cells[n][0] == "passed":
                            cells[n] = (rec["outcome"], rec.get("message", ""))
        if not cells and status == "finished" and proc.returncode not in (0, 1):
            status = "could not start"
        return RunResult(cells, status, time.monotonic() - start, head)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _reason(message: str, cell_timeout: float) -> str:
    """One line saying why a check cell failed, from nbval's report."""
    text = ANSI.sub("", message)
    if "Kernel died" in text or "Kernel dead" in text:
        return "kernel died (the notebook could not go on)"
    if "Timeout of" in text:
        return f"timed out (a cell ran over {cell_timeout:g} s)"
    m = re.search(r"CheckFailed: (.*)", text)
    if m:
        first = m.group(1).strip()
        if "not implemented yet" in first:
            return "task not implemented yet"
        return first if len(first) <= 200 else first[:200] + "..."
    if "Cell outputs differ" in text:
        return "the check's output differs from the expected PASS line"
    errors = [ln.strip() for ln in text.splitlines() if re.match(r"\s*\w*(Error|Exception)\b", ln.strip())]
    return errors[-1][:200] if errors else "check cell failed"


# ------------------------------------------------------------------------------------ grading


def grade(paths, out_csv: str | os.PathLike | None = None, timeout: float = DEFAULT_CELL_TIMEOUT,
          wall_timeout: float = DEFAULT_WALL_TIMEOUT, solutions_dir: str | os.PathLike | None = None,
          verbose: bool = True) -> list[dict]:
    """Grade each submission; returns one row per submission and writes `out_csv` when given.

    A row: {"submission", "exercise", "scores": {task: points}, "total", "max", "notes": {task: reason},
    "seconds", "status"}. `timeout` is per cell, `wall_timeout` per notebook (seconds).
    """
    import nbformat

    specs = load_specs(solutions_dir)
    rows = []
    for p in paths:
        path = Path(p)
        row = {"submission": str(path), "exercise": None, "scores": {}, "total": 0.0, "max": 0.0,
               "notes": {}, "seconds": 0.0, "status": ""}
        rows.append(row)
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception as e:  # noqa: BLE001 - unreadable file: no points, say why
            row["status"] = f"unreadable notebook: {type(e).__name__}: {str(e)[:200]}"
            exercise = _exercise_of(nbformat.v4.new_notebook(), path, specs)   # from the file name, if it says
            if exercise is not None:
                row["exercise"], row["max"] = exercise, sum(s.points for s in specs[exercise])
                row["scores"] = {s.task: 0.0 for s in specs[exercise]}
            _progress(verbose, row)
            continue
        exercise = _exercise_of(nb, path, specs)
        if exercise is None:
            row["status"] = "no exercise recognised (no check cells, no exNN in the file name)"
            _progress(verbose, row)
            continue
        row["exercise"] = exercise
        task_specs = specs[exercise]
        row["max"] = sum(s.points for s in task_specs)
        prepared, cell_of_task, problems = prepare(nb, task_specs)
        scratch = Path(tempfile.mkdtemp(prefix="minirt-grade-in-"))
        try:
            nb_file = scratch / "submission.ipynb"
            nbformat.write(prepared, nb_file)
            result = run_notebook(nb_file, timeout, wall_timeout)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        row["seconds"], row["status"] = result.seconds, result.status
        task_cell = {t: n for n, t in cell_of_task.items()}
        for spec in task_specs:
            t = spec.task
            score, note = 0.0, problems.get(t)
            if note is None:
                outcome = result.cells.get(task_cell[t])
                if outcome is None:
                    note = ("not run: the notebook hit the wall-clock limit of " f"{wall_timeout:g} s"
                            if result.status == "wall timeout" else f"not run ({result.status})")
                elif outcome[0] == "passed":
                    score = spec.points
                else:
                    note = _reason(outcome[1], timeout)
            row["scores"][t] = score
            if note:
                row["notes"][t] = note
        row["total"] = sum(row["scores"].values())
        _progress(verbose, row)
    if out_csv is not None:
        write_csv(rows, out_csv, specs)
    return rows


def _progress(verbose: bool, row: dict) -> None:
    if verbose:
        print(f"graded {row['submission']}: {row['total']:g}/{row['max']:g} "
              f"({row['seconds']:.1f} s{', ' + row['status'] if row['status'] not in ('', 'finished') else ''})",
              file=sys.stderr, flush=True)


def _columns(rows: list[dict], specs: dict[str, list[TaskSpec]]) -> list[str]:
    exercises = sorted({r["exercise"] for r in rows if r["exercise"]})
    return [s.task for e in exercises for s in specs[e]]


def write_csv(rows: list[dict], out_csv, specs: dict[str, list[TaskSpec]] | None = None) -> None:
    """One row per submission: submission, exercise, one column per task, total, max, notes."""
    specs = specs or {}
    tasks = _columns(rows, specs) if specs else sorted({t for r in rows for t in r["scores"]})
    with open(out_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "exercise", *tasks, "total", "max", "notes"])
        for r in rows:
            notes = "; ".join(f"{t}: {n}" for t, n in r["notes"].items())
            if r["status"] not in ("", "finished"):
                notes = f"{r['status']}" + (f"; {notes}" if notes else "")
            w.writerow([r["submission"], r["exercise"] or "",
                        *[(f"{r['scores'][t]:g}" if t in r["scores"] else "") for t in tasks],
                        f"{r['total']:g}", f"{r['max']:g}", notes])


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
        notes += [f"  {name} {t}: {n}" for t, n in r["notes"].items()]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


# ------------------------------------------------------------------------------------ command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `grade` subcommand to an argparse subparsers object (`python -m minirt grade ...`)."""
    p = subparsers.add_parser("grade", help="grade exercise notebooks (runs each under nbval, writes a CSV)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("submissions", nargs="+", help="submitted .ipynb files")
    p.add_argument("--out", default=None, help="write the grade sheet to this CSV file")
    p.add_argument("--timeout", type=float, default=DEFAULT_CELL_TIMEOUT,
                   help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    p.add_argument("--wall-timeout", type=float, default=DEFAULT_WALL_TIMEOUT,
                   help=f"seconds one whole notebook may run (default {DEFAULT_WALL_TIMEOUT})")
    p.add_argument("--solutions", default=None,
                   help="directory of the solution notebooks (default: solutions/ of this checkout)")
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
    rows = grade(args.submissions, args.out, args.timeout, args.wall_timeout, args.solutions)
    print(format_table(rows, specs))
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
