"""Submissions that try to forge a grade or reach outside themselves, graded together with an honest one.

Every attack rewrites one solution cell of exercise 03 (slot_mapping, 1 point; block_pool, 2; paged_attention,
2). Where an attack could help if it worked (reading the solutions, another submission, a file outside, the
network), the cell defines the correct `slot_mapping` when it succeeds and a wrong one when it fails, so a
point scored means the attack got through. Each must score 0 on the task it attacks, leave the others as an
honest notebook scores them, and leave nothing behind outside its temporary folder.
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

import nbformat

from minirt.course import grading, provenance, sandbox

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex03_paged_blocks.ipynb"
TASKS = ["ex03.slot_mapping", "ex03.block_pool", "ex03.paged_attention"]
FULL = (1, 2, 2)
CELL_TIMEOUT = 10
pytestmark = pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")

RIGHT = ("def slot_mapping(block_table, start, end, block_size):\n"
         "    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]\n")
WRONG = "def slot_mapping(block_table, start, end, block_size):\n    return []\n"


def _if(condition: str) -> str:
    """The correct slot_mapping if `condition` (an expression) holds after the attack, else a wrong one."""
    return f"if {condition}:\n" + "".join("    " + ln + "\n" for ln in RIGHT.splitlines()) + \
        "else:\n" + "".join("    " + ln + "\n" for ln in WRONG.splitlines())


def _solution_cell(nb, task):
    cells = nb.cells
    for i, c in enumerate(cells):
        if c.cell_type == "code" and c.metadata.get("minirt", {}).get("task") == task:
            return next(p for p in reversed(cells[:i]) if p.cell_type == "code")
    raise KeyError(task)


def _check_cell(nb, task):
    return next(c for c in nb.cells if c.metadata.get("minirt", {}).get("task") == task)


def _write(tmp: Path, name: str, source: str | None = None, task: str = "ex03.slot_mapping", edit=None) -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if source is not None:
        _solution_cell(nb, task).source = source
    if edit is not None:
        edit(nb)
    path = tmp / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def _attacks(tmp: Path, port: int, tag: str) -> dict[str, tuple[str, tuple, str | None]]:
    """name -> (cell source or editor, expected scores, words of the note on the attacked task, or a tuple of
    words any one of which will do)."""
    honest = tmp / "honest.ipynb"
    outside = [ROOT / "minirt" / "course" / f"pwned-{tag}", ROOT / f"pwned-{tag}", tmp / f"pwned-{tag}",
               Path(tempfile.gettempdir()) / f"pwned-{tag}"]
    return {
        "patch_checks": (  # the first forgery: a check that prints PASS, a wrong function
            "import minirt.course.checks as _c\n"
            "_c.ex03_slot_mapping = lambda fn: print('PASS ex03.slot_mapping (14/14 cases)')\n" + WRONG,
            (0, 0, 0), "tampers with the grader"),
        "read_solutions": (
            "import glob, os, minirt\n"
            f"_paths = glob.glob({str(ROOT / 'solutions' / 'ex03_*.ipynb')!r})\n"
            "_paths += glob.glob(os.path.join(os.path.dirname(minirt.__file__), '..', 'solutions', 'ex03_*'))\n"
            "_found = any('BEGIN SOLUTION' in open(p).read() for p in _paths)\n" + _if("_found"),
            (0, 2, 2), "slot_mapping failed on case"),
        "read_other_submission": (
            "import glob, os\n"
            f"_found = os.path.exists({str(honest)!r}) or bool(glob.glob('/tmp/minirt-grade-sub-*/plan.json'))\n"
            + _if("_found"), (0, 2, 2), "failed on case"),
        "hand_in_reference": ("from minirt.kv.paged_cache import slot_mapping\n", (0, 2, 2), "minirt's own"),
        "call_reference": ("from minirt.kv import paged_cache as _pc\n\ndef slot_mapping(*args):\n"
                           "    return _pc.slot_mapping(*args)\n", (0, 2, 2), "minirt's own"),
        "reference_by_name_at_run_time": (  # no name the AST screen knows: caught by the worker's report
            "import operator\nimport minirt.kv.paged_cache as _pc\n"
            "slot_mapping = operator.attrgetter('slot' + '_mapping')(_pc)\n", (0, 2, 2), "minirt's own"),
        "subclass_reference_pool": (
            "from minirt.kv import block_pool as _bp\n\nclass BlockPool(_bp.BlockPool):\n    pass\n",
            (1, 0, 2), "minirt's own"),
        "write_outside": (
            "_ok = []\n"
            f"for _p in {[str(p) for p in outside]!r}:\n"
            "    try:\n        open(_p, 'w').write('x')\n        _ok.append(_p)\n    except OSError:\n        pass\n"
            + _if("any(not p.startswith('/tmp/pwned') for p in _ok)"), (0, 2, 2), "failed on case"),
        "tcp_connect": (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n    _up = True\n"
            "except OSError:\n    _up = False\n" + _if("_up"), (0, 2, 2), "failed on case"),
        "sleep_forever": ("import time\ntime.sleep(10**6)\n" + RIGHT, (0, 2, 2), "timed out"),
        "fork_bomb": (  # in the last task's cell: the children hold the uid's process slots until the end
            "import os, time\n\ndef _bomb():\n    while True:\n        try:\n            os.fork()\n"
            "        except OSError:\n            time.sleep(0.05)\n\n_bomb()\n",
            (1, 2, 0), "timed out"),
        "allocate_forever": (
            "def _hog():\n    x = []\n    while True:\n        x.append(bytearray(64 * 2**20))\n\n_hog()\n" + RIGHT,
            (0, 2, 2), ("MemoryError", "timed out")),    # stopped by the memory limit, or by the clock first
        "print_forever": ("while True:\n    print('spam ' * 200)\n" + RIGHT, (0, 2, 2), "timed out"),
        "kill_kernel": ("import os\nos._exit(3)\n", (1, 0, 0), "kernel died"),
        "edit_check_cell": (
            lambda nb: (setattr(_solution_cell(nb, "ex03.slot_mapping"), "source", WRONG),
                        setattr(_check_cell(nb, "ex03.slot_mapping"), "source",
                                "print('PASS ex03.slot_mapping (14/14 cases)')")),
            (0, 2, 2), "check cell edited"),
        "patch_builtins": (  # not a route to the reference (a warning): it breaks its own worker, nothing else
            "import builtins\nbuiltins.len = lambda x: 0\n" + WRONG, (0, 0, 0),
            ("kernel died", "protocol", "failed on case", "not run")),
    }


def _listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    return s


def _uid_processes() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = next(ln.split()[1] for ln in f if ln.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if sandbox.slot_uid(0) <= int(uid) < sandbox.slot_uid(0) + sandbox.MAX_SLOTS:
                out.append(pid)
    return out


def _rows(out: Path) -> dict[str, dict]:
    with open(out, newline="") as f:
        return {Path(r["submission"]).stem: r for r in csv.DictReader(f)}


def test_attacks_score_zero_on_their_task_and_leave_nothing_behind(tmp_path, capsys):
    tag = f"{os.getpid()}"
    listener = _listener()
    try:
        attacks = _attacks(tmp_path, listener.getsockname()[1], tag)
        paths = [_write(tmp_path, "honest")]
        for name, (source, expected, _) in attacks.items():
            task = "ex03.paged_attention" if name == "fork_bomb" else \
                "ex03.block_pool" if name in ("subclass_reference_pool", "kill_kernel") else "ex03.slot_mapping"
            if callable(source):
                paths.append(_write(tmp_path, name, edit=source))
            else:
                paths.append(_write(tmp_path, name, source, task))
        before = set(os.listdir(tempfile.gettempdir()))
        out = tmp_path / "grades.csv"
        status = grading.main([*map(str, paths), "--out", str(out), "--timeout", str(CELL_TIMEOUT), "--jobs", "2"])
        assert status == 0
        try:
            conn, _ = listener.accept()
            conn.close()
            pytest.fail("a submission reached the listener on 127.0.0.1")
        except BlockingIOError:
            pass
    finally:
        listener.close()
    rows = _rows(out)
    assert tuple(int(rows["honest"][t]) for t in TASKS) == FULL and rows["honest"]["notes"] == ""
    assert {r["sandbox"] for r in rows.values()} == {"bwrap"}
    wrong = {}
    for name, (_, expected, words) in attacks.items():
        r = rows[name]
        got = tuple(int(float(r[t])) for t in TASKS)
        if got != expected or not any(w in r["notes"] for w in ((words,) if isinstance(words, str) else words)):
            wrong[name] = (got, r["notes"][:300])
    assert wrong == {}, wrong
    for p in [ROOT / "minirt" / "course" / f"pwned-{tag}", ROOT / f"pwned-{tag}", tmp_path / f"pwned-{tag}",
              Path(tempfile.gettempdir()) / f"pwned-{tag}"]:
        assert not p.exists(), p
    left = set(os.listdir(tempfile.gettempdir())) - before
    assert {n for n in left if n.startswith(('minirt-grade-', 'pwned'))} == set()  # every worker's folder is gone
    assert _uid_processes() == []                                               # the fork bomb's children too
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30).stdout == _git_status_before


_git_status_before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=30).stdout


def test_verdicts_hold_without_the_ast_screen(tmp_path, monkeypatch):
    """With the AST screens switched off, patching the checks inside the worker still scores nothing: the
    worker's grading functions are taken before the notebook runs and the comparison is the grader's."""
    monkeypatch.setattr(provenance, "screen", lambda sources: (None, []))
    monkeypatch.setattr(provenance, "scan", lambda sources, task, name: None)
    forge = ("import builtins, minirt.course.checks as _c\nfrom minirt.kv.paged_cache import slot_mapping as _r\n"
             "_c.ex03_slot_mapping = lambda fn: print('PASS ex03.slot_mapping (14/14 cases)')\n"
             "_c._outcome = lambda run, fn, inputs, student: ('ok', run(_r, inputs), '')\n"
             "_c.compare = lambda *a, **k: None\n_c._diff = lambda *a, **k: None\n"
             "builtins.print = lambda *a, **k: None\n" + WRONG.replace("slot_mapping", "slot_mapping_wrong")
             + "slot_mapping = slot_mapping_wrong\n")
    paths = [_write(tmp_path, "forge", forge), _write(tmp_path, "honest")]
    rows = grading.grade(paths, timeout=CELL_TIMEOUT, verbose=False)
    assert rows[0]["scores"] == dict(zip(TASKS, (0.0, 2.0, 2.0))), rows[0]["notes"]
    assert "failed on case" in rows[0]["notes"]["ex03.slot_mapping"]
    assert rows[1]["total"] == 5 and rows[1]["notes"] == {}


def test_worker_answers_are_data_never_pickle():
    from minirt.course import wire
    import torch

    value = {"a": (1, [2.5, None]), 3: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "s": "x"}
    back = wire.decode(wire.loads(wire.dumps(wire.encode(value))))
    assert back["a"] == (1, [2.5, None]) and back["s"] == "x" and torch.equal(back[3], value[3])
    assert isinstance(wire.decode(wire.encode(object())), wire.Opaque)
    with pytest.raises(ValueError):
        wire.decode({"$pickle": "gASV..."})
    with pytest.raises(ValueError):           # a dataclass is rebuilt only in the worker, from the grader's inputs
        wire.decode({"$dataclass": "minirt.attention:PagedAttentionMetadata", "fields": {}})
