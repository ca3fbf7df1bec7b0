"""Exercise first: no chapter shows an exercise's answer before the student has met the exercise.

An answer is the source of the minirt function a graded task asks for (`checks.REFERENCE_NAMES`).
A chapter cell "shows" it when its source or outputs hold at least `MIN_LINES` of that function's
distinctive code lines (docstring and short lines left out), however it got there
(`inspect.getsource`, `??`, a listing). The rules, for exercise NN and its chapter NN:

* chapters before NN never show it;
* chapter NN shows it only after the cell that links the exercise notebook (`../exercises/exNN_...`),
  and only folded, through `activities.reveal_source(..., exercise="exNN")`;
* later chapters may show it (the student has met the exercise).

Also: every chapter with an exercise links it, and every exercise links back to its chapter.
"""

from __future__ import annotations

import ast
import html
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest

from minirt.course import activities, provenance
from minirt.course.checks import REFERENCE_NAMES

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("ch[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("ex[0-9][0-9]_*.ipynb"))
MIN_LINES = 3          # distinctive lines of one answer in one cell that count as showing it (all, if fewer)
MIN_CHARS = 18         # shorter lines ("return out", "else:") are not distinctive


def answer_lines(task: str) -> set[str]:
    """The distinctive code lines of minirt's answer to `task`: stripped, docstrings left out."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(provenance.reference_objects(task)[0])))
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for n, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if n in docstrings or len(text) < MIN_CHARS or text.startswith(("#", "@")):
            continue
        lines.add(text)
    return lines


def _answers() -> dict[str, set[str]]:
    """Each task's distinctive lines, less those another task's answer shares (argument checks)."""
    lines = {task: answer_lines(task) for task in REFERENCE_NAMES}
    return {task: own - set().union(*(v for t, v in lines.items() if t != task))
            for task, own in lines.items()}


ANSWERS = _answers()


def _output_texts(cell) -> list[tuple[str, str]]:
    """(raw, plain) text of each output of a code cell."""
    texts = []
    for out in cell.get("outputs", []):
        parts = []
        if "text" in out:
            parts.append("".join(out["text"]))
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/"):
                parts.append("".join(value))
        for raw in parts:
            texts.append((raw, activities.html_text(raw)))
    return texts


def _shows(lines: set[str], text: str) -> bool:
    shown = {line.strip() for line in text.splitlines()}
    shown |= {re.sub(r"^\d+\s+", "", line) for line in shown}     # a listing's line numbers
    present = shown & lines
    return len(present) >= min(MIN_LINES, len(lines))


def _number(path: Path) -> int:
    return int(path.name[2:4])


def _intro_index(cells, exercise: str) -> int | None:
    """The cell that introduces the exercise: markdown linking its notebook and giving the command that
    makes the student's work copy (a passing mention elsewhere does not count)."""
    link = re.compile(rf"\(\.\./exercises/{exercise}_\w+\.ipynb\)")
    start = f"python -m minirt exercise start {exercise}"
    return next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                 and link.search("".join(c["source"])) and start in "".join(c["source"])), None)


def violations(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    chapter = _number(path)
    found = []
    for task, lines in ANSWERS.items():
        exercise = task.split(".")[0]
        number = int(exercise[2:])
        if number < chapter:
            continue
        intro = _intro_index(cells, exercise)
        for i, cell in enumerate(cells):
            where = f"{path.name} cell {i}"
            if _shows(lines, "".join(cell["source"])):
                found.append(f"{where}: its source holds {task}'s answer")
            for raw, plain in _output_texts(cell):
                if not _shows(lines, plain):
                    continue
                if number > chapter:
                    found.append(f"{where}: shows {task}'s answer, a chapter before exercise {number:02d}")
                elif intro is None or i < intro:
                    found.append(f"{where}: shows {task}'s answer before the cell that links exercise "
                                 f"{exercise} (cell {intro})")
                elif f'data-minirt-reveal="{exercise}"' not in raw:
                    found.append(f"{where}: shows {task}'s answer unfolded; use "
                                 f'activities.reveal_source(..., exercise="{exercise}")')
    return found


def test_every_task_has_distinctive_lines():
    thin = {task: len(lines) for task, lines in ANSWERS.items() if len(lines) < 2}
    assert not thin, f"answers too short to recognise in a chapter: {thin}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_shows_no_answer_before_its_exercise(chapter):
    problems = violations(chapter)
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_printed_answer(tmp_path):
    """The check itself: a chapter printing ex01's answer before linking it is caught."""
    listing = inspect.getsource(provenance.reference_objects("ex01.naive_generate")[0])
    cells = [{"cell_type": "code", "source": "print(inspect.getsource(naive_generate))", "metadata": {},
              "outputs": [{"output_type": "stream", "name": "stdout", "text": listing}]},
             {"cell_type": "markdown", "metadata": {},
              "source": "Now: [exercise 01](../exercises/ex01_naive_loop.ipynb), "
                        "`python -m minirt exercise start ex01`"}]
    nb = tmp_path / "ch01_x.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    assert any("before the cell that links" in v for v in violations(nb))
    cells.reverse()                                   # after the link, but unfolded
    nb.write_text(json.dumps({"cells": cells}))
    assert any("unfolded" in v for v in violations(nb))
    cells[1]["outputs"] = [{"output_type": "display_data", "metadata": {}, "data": {
        "text/html": f'<details data-minirt-reveal="ex01"><pre>{html.escape(listing)}</pre></details>'}}]
    nb.write_text(json.dumps({"cells": cells}))
    assert violations(nb) == []
    numbered = activities.source_ref("minirt.generate.naive.naive_generate").listing_html()
    cells[1]["outputs"][0]["data"]["text/html"] = numbered          # a treasure hunt's numbered listing
    nb.write_text(json.dumps({"cells": cells}))
    assert any("unfolded" in v for v in violations(nb))


def _exercises_by_chapter() -> dict[int, str]:
    return {_number(p): p.stem.split("_")[0] for p in SOLUTIONS}


@pytest.mark.parametrize("chapter", [p for p in CHAPTERS if _number(p) in _exercises_by_chapter()],
                         ids=lambda p: p.stem)
def test_chapter_links_its_exercise(chapter):
    exercise = _exercises_by_chapter()[_number(chapter)]
    cells = json.loads(chapter.read_text(encoding="utf-8"))["cells"]
    assert _intro_index(cells, exercise) is not None, \
        f"{chapter.name}: no markdown cell links ../exercises/{exercise}_*.ipynb with its `exercise start` command"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_exercise_links_its_chapter(solution):
    chapter = next((p for p in CHAPTERS if _number(p) == _number(solution)), None)
    assert chapter is not None, f"{solution.name}: no chapter {_number(solution):02d}"
    first = json.loads(solution.read_text(encoding="utf-8"))["cells"][0]
    assert f"(../chapters/{chapter.name})" in "".join(first["source"]), \
        f"{solution.name}: its first cell does not link ../chapters/{chapter.name}"
