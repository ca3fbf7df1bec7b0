"""minirt's reference is unreachable while the student's code runs: a property of the worker, not of the screen.

With the AST screen switched off (its notes and warnings never reach a verdict here), every route to the reference of
the graded task must still score 0 on that task: the reference handed in, one step away (a list, functools.partial,
a pickle constant, a star import, operator.attrgetter), a copy of its code object or of its module's source, a magic,
a worker whose identity report is replaced, and ex06's drive object asked for its own `schedule()`. Oracle: each
notebook differs from the solution in one cell, so the other task scores as the honest notebook does (4/4 alone).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import nbformat
import pytest

import minirt.scheduler
from minirt.course import grading, provenance, sandbox

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex06_chunked_prefill.ipynb"
SPLIT, SCHEDULE = "ex06.split_budget", "ex06.schedule"

ROUTES = {   # name -> (task attacked, the cell that replaces its solution)
    "hand_in": (SPLIT, "from minirt.scheduler import split_budget\n"),
    "in_a_list": (SPLIT, "import minirt.scheduler as _s\n_r = [_s.split_budget]\nsplit_budget = _r[0]\n"),
    "partial": (SPLIT, "import functools, minirt.scheduler as _s\nsplit_budget = functools.partial(_s.split_budget)\n"),
    "pickle_constant": (SPLIT, f"import pickle\nsplit_budget = pickle.loads({pickle.dumps(minirt.scheduler.split_budget)!r})\n"),
    "star_import": (SPLIT, "from minirt.scheduler import *\n"),
    "attrgetter": (SPLIT, "import operator, minirt.scheduler as _s\n"
                          "split_budget = operator.attrgetter('split_' + 'budget')(_s)\n"),
    "code_object_copy": (SPLIT, "import types, minirt.scheduler as _s\n"
                                "split_budget = types.FunctionType(_s.split_budget.__code__, vars(_s))\n"),
    "module_source_copy": (SPLIT, "import minirt.scheduler as _s\n_ns = {'__name__': 'copy'}\n"
                                  "exec(compile(open(_s.__file__).read(), 'copy.py', 'exec'), _ns)\n"
                                  "split_budget = _ns['split_budget']\n"),
    "magic": (SPLIT, "%%capture\nfrom minirt.scheduler import split_budget\n"),
    "forged_identity": (SPLIT, "import minirt.course.worker as _w\n_w.identity = lambda obj, task: None\n"
                               "from minirt.scheduler import split_budget\n"),
    "forked_helper": (SPLIT, (  # a process forked before the cases start would keep an unblocked reference
        "import os, pickle, minirt.scheduler as _s\n_r1, _w1 = os.pipe()\n_r2, _w2 = os.pipe()\n"
        "if os.fork() == 0:\n    try:\n        while True:\n            _n = int.from_bytes(os.read(_r1, 4), 'little')\n"
        "            _out = pickle.dumps(_s.split_budget(*pickle.loads(os.read(_r1, _n))))\n"
        "            os.write(_w2, len(_out).to_bytes(4, 'little') + _out)\n    finally:\n        os._exit(0)\n"
        "os.close(_r1)\nos.close(_w2)\n\ndef split_budget(*args):\n    _b = pickle.dumps(args)\n"
        "    os.write(_w1, len(_b).to_bytes(4, 'little') + _b)\n    _n = int.from_bytes(os.read(_r2, 4), 'little')\n"
        "    return pickle.loads(os.read(_r2, _n))\n")),
    "drive_object_method": (SCHEDULE, "schedule = lambda s: s.schedule()\n"),
    "drive_object_method_in_def": (SCHEDULE, "def schedule(scheduler):\n    return type(scheduler).schedule(scheduler)\n"),
}


def _write(tmp: Path, name: str, task: str | None = None, source: str | None = None) -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if task is not None:
        i = next(k for k, c in enumerate(nb.cells) if c.metadata.get("minirt", {}).get("task") == task)
        j = max(k for k in range(i) if nb.cells[k].cell_type == "code")
        nb.cells[j].source = source
    path = tmp / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_the_reference_is_unreachable_while_grading(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "screen", lambda sources: (None, []))
    monkeypatch.setattr(provenance, "scan", lambda sources, task, name: None)
    paths = [_write(tmp_path, "honest")] + [_write(tmp_path, n, t, s) for n, (t, s) in ROUTES.items()]
    rows = {Path(r["submission"]).stem: r for r in grading.grade(paths, timeout=30, verbose=False, jobs=2)}
    assert rows["honest"]["scores"] == {SPLIT: 1.0, SCHEDULE: 3.0} and rows["honest"]["notes"] == {}
    wrong = {}
    for name, (task, _) in ROUTES.items():
        r = rows[name]
        other = SCHEDULE if task == SPLIT else SPLIT
        words = "failed on case" if name == "forked_helper" else "minirt's own implementation"
        full = 0.0 if name == "forked_helper" else 3.0 if other == SCHEDULE else 1.0   # its schedule calls it
        if r["scores"][task] != 0 or r["scores"][other] != full or \
                words not in r["notes"].get(task, ""):
            wrong[name] = (r["scores"], r["notes"].get(task, "")[:200], r["status"])
    assert wrong == {}, wrong
