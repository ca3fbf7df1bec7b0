"""Submissions that try to take the whole grading run down, each graded in its own `python -m minirt grade` run
beside an honest notebook (a subprocess with a timeout: a crash or a hang fails this test, not the suite).

Oracle: the honest notebook graded alone scores 4/4 with no note; beside each attack it must score exactly that,
the attack must score 0 on the task it attacks, the run must end with both rows in the CSV, and nothing may be
left behind (no worker folder, no process of a slot's uid). The grader's own failures and a grading that hangs
are contained per submission too (a row "grader error: ...", the others graded as usual).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from minirt.course import grading, sandbox

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex06_chunked_prefill.ipynb"
TASKS = ["ex06.split_budget", "ex06.schedule"]
WRONG = "def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n    return 0, []\n"
needs_bwrap = pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")


def solution_cell(nb, task: str):
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code" and c.metadata.get("minirt", {}).get("task") == task:
            return next(p for p in reversed(nb.cells[:i]) if p.cell_type == "code")
    raise KeyError(task)


def write(tmp: Path, name: str, source: str | None = None, task: str = "ex06.split_budget") -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if source is not None:
        solution_cell(nb, task).source = source
    path = tmp / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def rows_of(out: Path) -> dict[str, dict]:
    with open(out, newline="") as f:
        return {Path(r["submission"]).stem: r for r in csv.DictReader(f)}


def uid_processes(uids: set[int]) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = int(next(ln.split()[1] for ln in f if ln.startswith("Uid:")))
            except (OSError, StopIteration):
                continue
            if uid in uids:
                out.append(pid)
    return out


LIAR = ("import torch\n\nclass _Liar(torch.Tensor):\n    @property\n    def shape(self):\n"
        "        return torch.Size([-2, -1])\n\n"
        "def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n"
        "    return torch.tensor([1, 2]).as_subclass(_Liar)\n")
PIPE = ("import os\n_junk = [b'[' * 200000 + b'\\n', b'{\"event\": \"task\", \"task\": 5}\\n', b'\\xff\\xfe\\n']\n"
        "for _fd in range(3, 64):\n    for _j in _junk:\n        try:\n            os.write(_fd, _j)\n"
        "        except OSError:\n            pass\n" + WRONG)
DEEP = "x = " + " + ".join(["1"] * 7000) + "\n" + WRONG
MAIN = "if False:\n    import minirt.__main__\n" + WRONG
HUGE = ("def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n"
        "    return 'x' * (60 * 2**20), []\n")
# name -> (cell, expected split_budget score, words in the attack's notes)
ATTACKS = {
    "lying_tensor_shape": (LIAR, 0, "could not be read"),
    "garbage_on_the_protocol_pipe": (PIPE, 0, "protocol"),
    "cell_too_deep_to_parse": (DEEP, 0, ("failed on case", "kernel died")),   # the worker's own compiler may die
    "import_minirt_main": (MAIN, 0, "failed on case"),
    "sixty_megabyte_reply": (HUGE, 0, "longer than the grader reads"),
}


@needs_bwrap
def test_no_submission_takes_the_run_down(tmp_path):
    honest = write(tmp_path, "honest")
    wrong = {}
    for name, (source, expected, words) in ATTACKS.items():
        attack = write(tmp_path, name, source)
        out = tmp_path / f"{name}.csv"
        before = set(os.listdir(tempfile.gettempdir()))
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "minirt", "grade", str(honest), str(attack), "--jobs", "2",
                                 "--timeout", "30", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        seconds = time.monotonic() - start
        if proc.returncode != 0 or not out.exists():
            wrong[name] = f"exit {proc.returncode}: {stderr[-600:]}"
            continue
        rows = rows_of(out)
        h, a = rows["honest"], rows[name]
        if (h["ex06.split_budget"], h["ex06.schedule"], h["notes"]) != ("1", "3", ""):
            wrong[name] = f"honest graded {h}"
        elif float(a["ex06.split_budget"]) != expected or \
                not any(w in a["notes"] for w in ((words,) if isinstance(words, str) else words)):
            wrong[name] = f"attack graded {a['ex06.split_budget']}, {a['notes'][:300]}"
        elif seconds > 300:
            wrong[name] = f"took {seconds:.0f} s"
        # what this run's grader left (other graders on the machine make folders of their own uids)
        uids = {sandbox.BASE_UID + (proc.pid % 100_000) * sandbox.MAX_SLOTS + s for s in range(sandbox.MAX_SLOTS)}
        left = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("minirt-grade-")
                and os.stat(os.path.join(tempfile.gettempdir(), n)).st_uid in uids}
        if left or uid_processes(uids):
            wrong[name] = f"left behind {left} {uid_processes(uids)}"
    assert wrong == {}, wrong


def test_a_grader_error_or_hang_costs_one_row_only(tmp_path, monkeypatch):
    """The grader's own failure on one submission (any BaseException) and a grading that hangs past its wall clock
    are rows of their own ("grader error: ..."); the others are graded, and the CSV has every row."""
    paths = [write(tmp_path, "breaks_grader"), write(tmp_path, "honest"), write(tmp_path, "hangs_grader")]
    real = grading.run_submission

    def flaky(nb, *args, **kw):
        source = "".join(c.source for c in nb.cells)
        if "# breaks" in source:
            raise KeyboardInterrupt("boom")
        if "# hangs" in source:
            time.sleep(12)
            return grading.RunResult({}, {}, "finished", 12.0, "")
        return real(nb, *args, **kw)

    for p, mark in ((paths[0], "# breaks"), (paths[2], "# hangs")):
        nb = nbformat.read(p, as_version=4)
        nb.cells[0].source += f"\n{mark}\n"
        nbformat.write(nb, p)
    monkeypatch.setattr(grading, "run_submission", flaky)
    monkeypatch.setattr(grading, "WATCHDOG_MARGIN", 1.0)
    out = tmp_path / "grades.csv"
    rows = grading.grade(paths[:2], out, timeout=20, verbose=False, jobs=2, sandbox="none")
    assert rows[0]["status"].startswith("grader error: KeyboardInterrupt") and rows[0]["total"] == 0
    assert rows[1]["total"] == 4 and rows[1]["notes"] == {}
    assert set(rows_of(out)) == {"breaks_grader", "honest"}
    hung = grading.grade(paths[2:], out, timeout=20, wall_timeout=2, verbose=False, sandbox="none")
    assert hung[0]["status"].startswith("grader error: grading ran past 3 s"), hung[0]["status"]
    assert rows_of(out)["hangs_grader"]["total"] == "0"


def test_a_grader_error_once_is_graded_again(tmp_path, monkeypatch):
    """The grader failing once on a submission is its own fault: the submission is graded once more and keeps its
    marks, and the row's warnings say that it was graded twice and why."""
    path = write(tmp_path, "honest")
    real, calls = grading.run_submission, []

    def once(nb, *args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the grader tripped")
        return real(nb, *args, **kw)

    monkeypatch.setattr(grading, "run_submission", once)
    (row,) = grading.grade([path], timeout=20, verbose=False, sandbox="none")
    assert len(calls) == 2
    assert (row["total"], row["notes"], row["status"]) == (4, {}, "finished")
    assert "graded twice" in row["warnings"] and "the grader tripped" in row["warnings"], row["warnings"]


def test_worker_messages_are_validated_before_use():
    from minirt.course import wire

    with pytest.raises(ValueError):
        wire.parse(b"[" * 100_000)
    with pytest.raises(ValueError):
        wire.decode({"$tensor": {"dtype": "int64", "shape": [-2, -1], "data": "AAAAAAAAAAABAAAAAAAAAA=="}})
    with pytest.raises(ValueError):
        wire.decode({"$tensor": {"dtype": "complex128", "shape": [1], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}})
    with pytest.raises(ValueError):
        wire.decode({"$dict": [[[1, 2], 3]]})                  # a list as a dict key
    assert not grading.valid_event({"event": "task", "task": 5, "error": None, "identity": None})
    assert not grading.valid_event({"event": "cell", "index": 0, "error": None, "extra": 1})
    assert grading.valid_event({"event": "cell", "index": 0, "error": None})
    with pytest.raises(ValueError):
        grading._outcome_of({"kind": "ok", "value": 1})         # no "printed"
    assert grading.clean("a\x1b[2J\x1b[31mb\x1b]0;t\x07\rc\nd") == "ab" + "c\nd"
