"""Honest but unusual code scores full marks: reflection in a `__repr__`, `getattr(self, op)`, `import types`,
printing the word "schedule", a namedtuple where the check cell accepts one, recursion, helper classes, numpy
inside, many prints, an IPython magic. Oracle: the notebook's own check cells pass on the same code (run here
in-process, as the student sees them), and the grader must agree: every task full marks, no note (the screen's
hints may appear in the warnings column only)."""

from __future__ import annotations

import io
import contextlib
from pathlib import Path

import nbformat
import pytest

from minirt.course import checks, grading, sandbox

ROOT = Path(__file__).resolve().parent.parent

EX06_SPLIT = '''import collections, types
import numpy as np

Split = collections.namedtuple("Split", "decodes chunks")


class _Budget:
    """A helper class with reflection where honest code has it."""

    def __init__(self, left):
        self.left = left
        self.log = types.SimpleNamespace(taken=[])

    def __repr__(self):
        return f"{self.__class__.__name__}(left={self.left})"

    def take(self, n):
        got = min(n, self.left)
        self.left -= got
        self.log.taken.append(got)
        return got

    def apply(self, op, n):
        return getattr(self, op)(n)


def _chunks(budget, remaining, cap):            # recursion
    if not remaining:
        return []
    return [budget.apply("take", min(remaining[0], cap))] + _chunks(budget, remaining[1:], cap)


def split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):
    print("schedule: splitting", budget)
    for i in range(200):
        print("a print", i)
    b = _Budget(budget)
    decodes = b.take(num_decodes)
    chunks = np.array(_chunks(b, list(remaining_prompts), max_prefill_chunk), dtype=np.int64)
    print(repr(b))
    return Split(decodes, [int(c) for c in chunks])
'''
MAGIC = "%time _warm = sum(range(10))\nprint('the schedule comes next')\n"


def _honest_ex06(tmp: Path) -> Path:
    nb = nbformat.read(ROOT / "solutions" / "ex06_chunked_prefill.ipynb", as_version=4)
    cells = nb.cells
    i = next(k for k, c in enumerate(cells) if c.metadata.get("minirt", {}).get("task") == "ex06.split_budget")
    j = max(k for k in range(i) if cells[k].cell_type == "code")
    cells[j].source = EX06_SPLIT
    cells.insert(i + 1, nbformat.v4.new_code_cell(MAGIC))
    path = tmp / "honest_unusual_ex06.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_check_cell_accepts_the_honest_code():
    ns: dict = {}
    exec(compile(EX06_SPLIT, "<honest>", "exec"), ns)                 # noqa: S102 - the test's own code
    with contextlib.redirect_stdout(io.StringIO()) as out:
        checks.ex06_split_budget(ns["split_budget"])
    assert "PASS ex06.split_budget" in out.getvalue()


@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_honest_unusual_code_scores_full_marks(tmp_path):
    path = _honest_ex06(tmp_path)
    (row,) = grading.grade([path], timeout=30, verbose=False)
    assert row["scores"] == {"ex06.split_budget": 1.0, "ex06.schedule": 3.0}, row["notes"]
    assert row["notes"] == {} and row["status"] == "finished"
    assert "get_ipython" in row["warnings"]                      # the magic, read after IPython's transformation
