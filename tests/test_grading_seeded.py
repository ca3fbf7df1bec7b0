"""The grader's seeded extra cases: a table of the public cases' answers no longer scores.

Oracle: minirt's reference, run here on the public cases, gives the table; a notebook that answers from it passes
its own check cell (the public cases) but must score 0 with the extra cases of any seed, whose inputs the note
then shows; the honest notebook scores full marks on the same seed, and the seed is written beside the CSV.
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
