"""Bounded workers: a submission that fills its disk or prints terminal escapes harms no one else, and a sandbox
that cannot start is the grader's error, retried, never a student's zero.

Oracle: the honest notebook scores 4/4 with no note beside the attacks (as alone); the disk filler meets ENOSPC
inside its own size-limited /tmp (its function is correct only then) and the host's disk is untouched; no escape or control character
reaches the CSV; a worker that fails to start once is graded normally on the second attempt, one that never
starts is a row "grader error: ..." with every task 0 and the others graded.
"""

from __future__ import annotations

import csv
import errno
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest

from minirt.course import grading, sandbox

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex06_chunked_prefill.ipynb"
needs_bwrap = pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")

# correct only if the writes stopped with ENOSPC (errno 28) in its own /tmp: its full marks say the fill was contained
FILL = ("import os\n_n = 0\ntry:\n    while True:\n        with open(f'/tmp/fill{_n}', 'wb') as _f:\n"
        "            for _ in range(60):\n                _f.write(b'x' * 2**20)\n        _n += 1\n"
        "except OSError as e:\n    _err = e.errno\n"
        "def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n"
        "    decodes = min(num_decodes, budget)\n    left, chunks = budget - decodes, []\n"
        "    for r in remaining_prompts:\n        chunks.append(min(r, max_prefill_chunk, left))\n"
        "        left -= chunks[-1]\n    return (decodes, chunks) if _err == 28 else (0, [])\n")
ESCAPES = ("def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n"
           "    raise ValueError('\\x1b[2J\\x1b[1;1Hforged 5/5\\r\\x07\\x1b]0;title\\x07')\n")


def _write(tmp: Path, name: str, source: str | None = None) -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if source is not None:
        i = next(k for k, c in enumerate(nb.cells) if c.metadata.get("minirt", {}).get("task") == "ex06.split_budget")
        nb.cells[max(k for k in range(i) if nb.cells[k].cell_type == "code")].source = source
    path = tmp / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@needs_bwrap
def test_disk_fill_and_escapes_stay_with_their_submission(tmp_path, capsys):
    free_before = shutil.disk_usage(tempfile.gettempdir()).free
    paths = [_write(tmp_path, "fill", FILL), _write(tmp_path, "honest"), _write(tmp_path, "escapes", ESCAPES)]
    out = tmp_path / "grades.csv"
    assert grading.main([*map(str, paths), "--out", str(out), "--timeout", "60", "--jobs", "2"]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    with open(out, newline="") as f:
        rows = {Path(r["submission"]).stem: r for r in csv.DictReader(f)}
    assert (rows["honest"]["total"], rows["honest"]["notes"]) == ("4", "")
    assert rows["fill"]["total"] == "4", rows["fill"]
    assert rows["escapes"]["ex06.split_budget"] == "0" and "forged 5/5" in rows["escapes"]["notes"]
    for bad in ("\x1b", "\x07", "\r"):
        assert bad not in text and bad not in printed
    assert shutil.disk_usage(tempfile.gettempdir()).free > free_before - 2**30     # 64 MB at most, kept nowhere


def test_a_worker_that_cannot_start_is_retried_then_a_grader_error(tmp_path, monkeypatch):
    real = sandbox.Worker
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(sandbox, "Worker", flaky)
    (row,) = grading.grade([_write(tmp_path, "honest")], timeout=30, verbose=False, sandbox="none")
    assert (row["total"], row["notes"], calls["n"]) == (4, {}, 2)

    def never(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sandbox, "Worker", never)
    (row,) = grading.grade([_write(tmp_path, "honest")], timeout=30, verbose=False, sandbox="none")
    assert row["status"].startswith("grader error: the worker could not start") and row["total"] == 0
    assert "not your fault" in row["notes"]["ex06.split_budget"]
