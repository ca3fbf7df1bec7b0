"""The grader's seeded extra cases: a table of the public cases' answers no longer scores.

Oracle: minirt's reference, run here on the public cases, gives the table; a notebook that answers from it passes
its own check cell (the public cases) but must score 0 with the extra cases of any seed, whose inputs the note
then shows; the honest notebook scores full marks on the same seed, and the seed is written beside the CSV. Every
task of every exercise has extra cases, which differ from seed to seed, and the instructor's solutions of the
stateful, streaming and tensor-parallel exercises still score full marks on them.
"""

from __future__ import annotations

import csv
import io
import contextlib
from pathlib import Path

import nbformat
import pytest

from minirt.course import checks, grading, sandbox

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex06_chunked_prefill.ipynb"
#: the solutions whose tasks draw their extra cases from the Spec (ex04.match, ex05, ex08.delta_chunks, ex09, ex10,
#: ex11)
STATEFUL = [ROOT / "solutions" / f"{name}.ipynb"
            for name in ("ex04_prefix_cache", "ex05_engine", "ex08_serving", "ex09_tensor_parallel",
                         "ex10_quantization", "ex11_speculative_decoding")]


@pytest.mark.parametrize("task", list(checks.SPECS))
def test_every_task_has_seeded_cases(task):
    spec = checks.SPECS[task]()
    one, two = checks.extra_cases(task, 1, spec), checks.extra_cases(task, 2, spec)
    assert one, f"{task} has no seeded extra cases"
    assert [c.show for c in one] != [c.show for c in two], f"{task}: seeds 1 and 2 give the same cases"
    assert all(c.name.startswith("seeded case") and c.show for c in one)
    assert [c.show for c in one] == [c.show for c in checks.extra_cases(task, 1, spec)]   # a seed reproduces


def _table_cell() -> str:
    spec = checks.SPECS["ex06.split_budget"]()
    table = {repr(c.make()): checks.reference_outcome(spec, c)[1] for c in spec.cases}
    return (f"_TABLE = {table!r}\n\ndef split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk):\n"
            "    return _TABLE.get(repr((budget, num_decodes, remaining_prompts, max_prefill_chunk)), (0, []))\n")


def test_the_table_passes_the_notebook_check():
    ns: dict = {}
    exec(_table_cell(), ns)                                     # noqa: S102 - the test's own code
    with contextlib.redirect_stdout(io.StringIO()) as out:
        checks.ex06_split_budget(ns["split_budget"])
    assert "PASS" in out.getvalue()


@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_a_table_of_public_answers_scores_zero(tmp_path):
    nb = nbformat.read(SOLUTION, as_version=4)
    i = next(k for k, c in enumerate(nb.cells) if c.metadata.get("minirt", {}).get("task") == "ex06.split_budget")
    nb.cells[max(k for k in range(i) if nb.cells[k].cell_type == "code")].source = _table_cell()
    table = tmp_path / "table.ipynb"
    nbformat.write(nb, table)
    out = tmp_path / "grades.csv"
    assert grading.main([str(table), str(SOLUTION), "--out", str(out), "--seed", "7", "--jobs", "2"]) == 0
    with open(out, newline="") as f:
        rows = {Path(r["submission"]).stem: r for r in csv.DictReader(f)}
    note = rows["table"]["notes"]
    assert rows["table"]["ex06.split_budget"] == "0" and "seeded case" in note and "inputs:   budget=" in note
    assert rows[SOLUTION.stem]["total"] == "4" and rows[SOLUTION.stem]["notes"] == ""
    assert Path(f"{out}.seed").read_text().strip() == "7"


@pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")
def test_the_solutions_score_full_marks_on_the_extra_cases(tmp_path):
    out = tmp_path / "grades.csv"
    assert grading.main([*map(str, STATEFUL), "--out", str(out), "--seed", "11", "--jobs", "2"]) == 0
    with open(out, newline="") as f:
        rows = {Path(r["submission"]).stem: r for r in csv.DictReader(f)}
    assert {k: (r["total"], r["max"], r["notes"]) for k, r in rows.items() if r["total"] != r["max"] or r["notes"]} == {}
    assert len(rows) == len(STATEFUL)
