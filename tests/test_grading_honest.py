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
EX03_SLOTS = '''import numpy as np


def _slots(table, positions, block_size):          # recursion, numpy inside
    if len(positions) == 0:
        return []
    p = int(positions[0])
    return [int(table[p // block_size]) * block_size + p % block_size] + _slots(table, positions[1:], block_size)


def slot_mapping(block_table, start, end, block_size):
    print("slot_mapping of", start, end)
    return _slots(np.asarray(block_table, dtype=np.int64), np.arange(start, end), block_size)
'''
EX03_POOL = '''import types
from collections import deque


class _Free:
    """A helper class: the free list, least recently freed first."""

    def __init__(self, ids):
        self.q = deque(ids)

    def __repr__(self):
        return f"{type(self).__name__}({list(self.q)}) of {self.__class__.__module__}"

    def __len__(self):
        return len(self.q)


class BlockPool:
    def __init__(self, num_blocks):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.blocks = [types.SimpleNamespace(block_id=i, ref_count=0) for i in range(num_blocks)]
        self._free = _Free(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self._free)

    def _op(self, op, *args):
        return getattr(self, "_" + op)(*args)

    def allocate(self):
        return self._op("allocate")

    def acquire(self, block_id):
        return self._op("acquire", block_id)

    def release(self, block_id):
        return self._op("release", block_id)

    def _allocate(self):
        if not self._free.q:
            raise RuntimeError("no free block")
        b = self._free.q.popleft()
        self.blocks[b].ref_count = 1
        return b

    def _acquire(self, block_id):
        if self.blocks[block_id].ref_count == 0:
            self._free.q.remove(block_id)
        self.blocks[block_id].ref_count += 1

    def _release(self, block_id):
        if self.blocks[block_id].ref_count <= 0:
            raise RuntimeError(f"block {block_id} is free")
        self.blocks[block_id].ref_count -= 1
        if self.blocks[block_id].ref_count == 0:
            self._free.q.append(block_id)
'''
MAGIC = "%time _warm = sum(range(10))\nprint('the schedule comes next')\n"


def _replace_solution(nb, task: str, source: str) -> None:
    i = next(k for k, c in enumerate(nb.cells) if c.metadata.get("minirt", {}).get("task") == task)
    nb.cells[max(k for k in range(i) if nb.cells[k].cell_type == "code")].source = source


def _honest_ex03(tmp: Path) -> Path:
    nb = nbformat.read(ROOT / "solutions" / "ex03_paged_blocks.ipynb", as_version=4)
    _replace_solution(nb, "ex03.slot_mapping", EX03_SLOTS)
    _replace_solution(nb, "ex03.block_pool", EX03_POOL)
    path = tmp / "honest_unusual_ex03.ipynb"
    nbformat.write(nb, path)
    return path


def _honest_ex06(tmp: Path) -> Path:
    nb = nbformat.read(ROOT / "solutions" / "ex06_chunked_prefill.ipynb", as_version=4)
    cells = nb.cells
    i = next(k for k, c in enumerate(cells) if c.metadata.get("minirt", {}).get("task") == "ex06.split_budget")
    _replace_solution(nb, "ex06.split_budget", EX06_SPLIT)
    cells.insert(i + 1, nbformat.v4.new_code_cell(MAGIC))
    path = tmp / "honest_unusual_ex06.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_check_cell_accepts_the_honest_code():
    ns: dict = {}
    for source in (EX06_SPLIT, EX03_SLOTS, EX03_POOL):
        exec(compile(source, "<honest>", "exec"), ns)                 # noqa: S102 - the test's own code
    with contextlib.redirect_stdout(io.StringIO()) as out:
        checks.ex06_split_budget(ns["split_budget"])
        checks.ex03_slot_mapping(ns["slot_mapping"])
        checks.ex03_block_pool(ns["BlockPool"])
    assert out.getvalue().count("PASS") == 3


@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_honest_unusual_code_scores_full_marks(tmp_path):
    row, row03 = grading.grade([_honest_ex06(tmp_path), _honest_ex03(tmp_path)], timeout=60, verbose=False, jobs=2,
                               seed=1234)
    assert row["scores"] == {"ex06.split_budget": 1.0, "ex06.schedule": 3.0}, row["notes"]
    assert row["notes"] == {} and row["status"] == "finished"
    assert "get_ipython" in row["warnings"]                      # the magic, read after IPython's transformation
    assert row03["total"] == row03["max"] == 5 and row03["notes"] == {}, (row03["status"], row03["notes"])
    assert row03["status"] == "finished", row03["status"]
