"""Every solution notebook grades to full marks, and the grader and the notebook's check agree on the same values.

Oracle: the instructor's solutions pass their own check cells (their committed outputs say PASS), so the grader,
which carries every case's inputs to a worker and back as data, must score each task in full. For each task the
inputs after a round trip through the wire (as the worker rebuilds them) must be the inputs the check makes, and the
reference's answer after a round trip must compare equal to itself with the check's own comparison.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minirt.course import checks, grading, sandbox, wire

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("ex[0-9][0-9]_*.ipynb"))


def _same(a, b) -> bool:
    """Equal as the inputs of a case: tensors by dtype, shape and values; modules by their type and tensors;
    dataclasses and containers field by field."""
    if isinstance(a, torch.nn.Module):
        return type(a) is type(b) and all(_same(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("task", list(checks.TASKS))
def test_the_check_and_the_grader_see_the_same_values(task):
    spec = checks.SPECS[task]()
    for case in spec.cases + checks.extra_cases(task, seed=1):
        inputs = case.make()
        sent = wire.decode(wire.loads(wire.dumps(wire.encode(inputs))), device=checks.device(), rebuild=True)
        assert _same(inputs, sent), (task, case.name)
        expected = checks.reference_outcome(spec, case)
        if expected[0] == "ok":
            back = wire.decode(wire.loads(wire.dumps(wire.encode(expected[1]))), device=checks.device())
            assert checks.compare(task, 1, case, 1, expected, ("ok", back)) is None, (task, case.name)


@pytest.mark.slow
@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_every_solution_grades_to_full_marks():
    rows = grading.grade(SOLUTIONS, timeout=120, verbose=False, jobs=2, seed=int.from_bytes(os.urandom(4), "little"))
    short = {Path(r["submission"]).name: (r["total"], r["max"], r["notes"], r["status"]) for r in rows
             if r["total"] != r["max"] or r["notes"] or r["status"] != "finished"}
    assert short == {}, short
    assert len(rows) == len(SOLUTIONS) >= 9
