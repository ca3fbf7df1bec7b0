"""The grading CLI: correct, wrong, hanging, kernel-killing, check-cell-edited and output-flooding
submissions, built from the solution notebooks, each score what they deserve, independently."""

from __future__ import annotations

import argparse
import copy
import csv
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex06_chunked_prefill.ipynb"     # the fastest notebook: no model
TASKS = ["ex06.split_budget", "ex06.schedule"]                    # 1 and 3 points

import ipykernel  # noqa: F401,E402  (grading needs the notebooks extra: pip install -e '.[notebooks]')
import nbformat  # noqa: E402
import nbval  # noqa: F401,E402

from minirt.course import grading  # noqa: E402


def _code_cell(nb, task_cell_of: str | None = None, solution_of: str | None = None):
    """The check cell of a task, or the solution cell that comes right before it."""
    cells = nb.cells
    for i, c in enumerate(cells):
        if c.cell_type == "code" and c.metadata.get("minirt", {}).get("task") == (task_cell_of or solution_of):
            if task_cell_of:
                return c
            return next(p for p in reversed(cells[:i]) if p.cell_type == "code")
    raise KeyError(task_cell_of or solution_of)


def _variant(tmp: Path, name: str, edit) -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    edit(nb)
    path = tmp / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def _wrong(nb):                       # forgets the per-request chunk cap: both tasks fail
    c = _code_cell(nb, solution_of="ex06.split_budget")
    c.source = c.source.replace("min(remaining, max_prefill_chunk, left)", "min(remaining, left)")


def _hang(nb):                        # schedule spins forever: only its check times out
    c = _code_cell(nb, solution_of="ex06.schedule")
    c.source = c.source.replace("    cfg = scheduler.config\n", "    while True:\n        pass\n", 1)


def _kill(nb):                        # the kernel dies in the second task's solution cell
    c = _code_cell(nb, solution_of="ex06.schedule")
    c.source = "import os\nos._exit(3)\n" + c.source


def _edited(nb):                      # a check cell that no longer checks
    c = _code_cell(nb, task_cell_of="ex06.split_budget")
    c.source = "print('PASS ex06.split_budget (13/13 cases)')"


def _flood(nb):                       # megabytes printed by a solution cell, stale outputs stored everywhere
    c = _code_cell(nb, solution_of="ex06.split_budget")
    c.source += "\nfor _ in range(30000):\n    print('spam ' * 40)\n"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stale output\n")]


def _stored_failure(nb):              # correct code, but the notebook was saved with a failing check output
    c = _code_cell(nb, task_cell_of="ex06.schedule")
    c.outputs = [nbformat.v4.new_output("error", ename="CheckFailed", evalue="old run", traceback=["old run"])]


def _typo(nb):                        # the second task's solution cell does not compile: its function is missing
    c = _code_cell(nb, solution_of="ex06.schedule")
    c.source = "def schedule(scheduler)\n    pass\n"


def test_grade_cli_scores_each_submission_on_its_own(tmp_path, capsys):
    subs = {name: _variant(tmp_path, name, edit) for name, edit in [
        ("correct", lambda nb: None), ("wrong", _wrong), ("hang", _hang), ("kill", _kill),
        ("edited", _edited), ("flood", _flood), ("stored_failure", _stored_failure), ("typo", _typo)]}
    out = tmp_path / "grades.csv"
    status = grading.main([*map(str, subs.values()), "--out", str(out), "--timeout", "20"])
    assert status == 0
    printed = capsys.readouterr().out

    with open(out, newline="") as f:
        rows = {Path(r["submission"]).stem: r for r in csv.DictReader(f)}
    assert list(rows) == list(subs)
    expected = {  # (split_budget, schedule, total)
        "correct": ("1", "3", "4"), "wrong": ("0", "0", "0"), "hang": ("1", "0", "1"), "kill": ("1", "0", "1"),
        "edited": ("0", "3", "3"), "flood": ("1", "3", "4"), "stored_failure": ("1", "3", "4"),
        "typo": ("1", "0", "1")}
    for name, (a, b, total) in expected.items():
        r = rows[name]
        assert (r["ex06.split_budget"], r["ex06.schedule"], r["total"]) == (a, b, total), (name, r)
        assert r["max"] == "4" and r["exercise"] == "ex06"
    assert rows["correct"]["notes"] == ""
    assert "prompt longer than the chunk cap" in rows["wrong"]["notes"]
    # the note is the check's whole message: the case, its inputs, expected and got (no traceback)
    wrong = rows["wrong"]["notes"]
    assert "inputs:   budget=" in wrong and "expected" in wrong and " got " in wrong, wrong
    assert "Traceback" not in wrong and "checks.py" not in wrong, wrong
    # a failed cell is named as a student finds it: its number among all cells and the heading above it
    typo = rows["typo"]["notes"]
    nb = nbformat.read(subs["typo"], as_version=4)
    number = next(i for i, c in enumerate(nb.cells, 1) if c.source.startswith("def schedule(scheduler)\n"))
    assert f"a cell before failed: cell {number} (under 'Task 2" in typo and "SyntaxError" in typo, typo
    assert "ex06.schedule: timed out" in rows["hang"]["notes"]
    assert "ex06.schedule: kernel died" in rows["kill"]["notes"]
    assert "ex06.split_budget: check cell edited" in rows["edited"]["notes"]
    assert "correct.ipynb" in printed and "4/4" in printed and "ex06.schedule" in printed


def test_prepare_finds_edited_and_missing_check_cells():
    specs = grading.load_specs(ROOT / "solutions")["ex06"]
    assert [(s.task, s.points) for s in specs] == [("ex06.split_budget", 1.0), ("ex06.schedule", 3.0)]
    nb = nbformat.read(SOLUTION, as_version=4)

    prepared, cell_of_task, problems = grading.prepare(nb, specs)
    assert problems == {} and sorted(cell_of_task.values()) == sorted(TASKS)
    for cell in prepared.cells:
        if cell.cell_type == "code" and cell.metadata.get("minirt", {}).get("task") is None:
            assert cell.outputs == [] and cell.execution_count is None

    edited = copy.deepcopy(nb)
    _code_cell(edited, task_cell_of="ex06.schedule").source += "\n# harmless?"
    assert grading.prepare(edited, specs)[2] == {"ex06.schedule": "check cell edited (its source differs from "
                                                                  "the original)"}
    trailing = copy.deepcopy(nb)
    _code_cell(trailing, task_cell_of="ex06.schedule").source += "   \n\n"      # whitespace only: not an edit
    assert grading.prepare(trailing, specs)[2] == {}

    missing = copy.deepcopy(nb)
    missing.cells = [c for c in missing.cells if c.metadata.get("minirt", {}).get("task") != "ex06.schedule"]
    assert grading.prepare(missing, specs)[2] == {"ex06.schedule": "check cell missing"}

    no_metadata = copy.deepcopy(nb)                       # metadata stripped by an editor: found by its call
    for c in no_metadata.cells:
        c.metadata = {}
    prepared, cell_of_task, problems = grading.prepare(no_metadata, specs)
    assert problems == {} and sorted(cell_of_task.values()) == sorted(TASKS)


def test_subcommand_wiring():
    parser = argparse.ArgumentParser(prog="python -m minirt")
    sub = parser.add_subparsers(dest="command", required=True)
    grading.add_parser(sub)
    args = parser.parse_args(["grade", "a.ipynb", "b.ipynb", "--out", "g.csv", "--timeout", "60"])
    assert (args.command, args.submissions, args.out, args.timeout) == ("grade", ["a.ipynb", "b.ipynb"], "g.csv", 60)
    assert grading.run(args) == 2                         # no such files: refused before running anything


def test_report_and_csv_name_the_sandbox(tmp_path, capsys):
    from minirt.course import sandbox

    sub = _variant(tmp_path, "correct", lambda nb: None)
    out = tmp_path / "grades.csv"
    assert grading.main([str(sub), "--out", str(out), "--sandbox", "none"]) == 0
    captured = capsys.readouterr()
    assert "sandbox: none" in captured.out and "warning: grading with sandbox 'none'" in captured.err
    with open(out, newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["sandbox"], row["total"], row["notes"]) == ("none", "4", "")
    rows = grading.grade([sub], verbose=False)                      # auto: the best that runs here
    assert rows[0]["sandbox"] == sandbox.resolve("auto") and rows[0]["total"] == 4
