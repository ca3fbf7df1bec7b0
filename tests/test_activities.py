"""Self-check activities: the quiz data files, the widgets, live source references, and the cell tool.

* every chapter's data file (`minirt/course/quizzes/chNN.json`) is well formed: exactly one correct answer
  per multiple-choice question, an explanation, a section pointer that is a heading of that chapter;
* the quiz widget answers as a student would (set a value, read the feedback, check the score);
* every symbol a chapter names - `minirt.x.y` in text or code, names imported from minirt and their
  attributes, `source_ref(...)` calls, treasure-hunt answers - still exists (any notebook in chapters/);
* `tools/add_activities.py` is idempotent and replaces an existing activities section.

No kernel and no model: a few seconds.
"""

from __future__ import annotations

import ast
import html
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from minirt.course import activities

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS_DIR = ROOT / "chapters"
NOTEBOOKS = sorted(CHAPTERS_DIR.glob("ch[0-9][0-9]_*.ipynb"))
DATA_FILES = sorted(activities.QUIZ_DIR.glob("ch[0-9][0-9].json"))
ALL_CHAPTERS = sorted({f"ch{n:02d}" for n in range(7)} | {p.stem for p in DATA_FILES})

sys.path.insert(0, str(ROOT / "tools"))
import add_activities  # noqa: E402

widgets = pytest.importorskip("ipywidgets")


def notebook_of(chapter: str) -> Path | None:
    return next(iter(CHAPTERS_DIR.glob(f"{chapter}_*.ipynb")), None)


def headings(path: Path) -> set[str]:
    nb = nbformat.read(path, as_version=4)
    return {line.lstrip("#").strip() for c in nb.cells if c.cell_type == "markdown"
            for line in c.source.splitlines() if re.match(r"#{1,6} ", line)}


# ----------------------------------------------------------------------------------- data files


def test_data_file_for_every_chapter():
    have = {p.stem for p in DATA_FILES}
    assert set(ALL_CHAPTERS) <= have, f"missing activity data: {sorted(set(ALL_CHAPTERS) - have)}"
    for nb in NOTEBOOKS:
        assert activities.chapter_id(nb.name) in have, f"{nb.name} has no {activities.chapter_id(nb.name)}.json"


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.stem)
def test_data_file_well_formed(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["chapter"] == path.stem
    assert activities.validate(data) == []
    for q in data["quiz"]:
        if q["kind"] == "choice":
            assert sum(c["correct"] is True for c in q["choices"]) == 1, q["id"]
        assert len(q["explanation"]) >= 60 and q["section"].strip(), q["id"]


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.stem)
def test_section_pointers_are_headings_of_the_chapter(path):
    nb = notebook_of(path.stem)
    if nb is None:
        pytest.skip(f"no notebook for {path.stem} yet")
    heads = headings(nb)
    data = activities.load(path.stem)
    missing = [q["section"] for q in data["quiz"] if q["section"] not in heads]
    assert not missing, f"{path.stem}: quiz sections not found among the headings of {nb.name}: {missing}"


def test_validate_catches_bad_questions():
    data = json.loads(json.dumps(activities.load("ch03")))
    q = data["quiz"][3]
    assert q["kind"] == "choice"
    for c in q["choices"]:
        c["correct"] = True
    data["quiz"][0]["explanation"] = ""
    del data["quiz"][1]["section"]
    problems = "\n".join(activities.validate(data))
    assert "4 correct choices" in problems and "explanation" in problems and "'section'" in problems


@pytest.mark.parametrize("chapter", ALL_CHAPTERS)
def test_hunt_answers_point_at_live_source(chapter):
    for h in activities.load(chapter)["hunt"]:
        ref = activities.source_ref(h["symbol"], h.get("marker"), h.get("end_marker"))
        assert ref.lines and ref.start <= ref.end
        if h.get("marker"):
            assert h["marker"] in ref.lines[0]
        if h.get("end_marker"):
            assert h["end_marker"] in ref.lines[-1]
    page = activities.hunt_html(chapter)
    assert page.count("<details><summary>Answer</summary>") == len(activities.load(chapter)["hunt"])


# ----------------------------------------------------------------------------------- widgets


def test_quiz_widget_answers_feedback_and_score():
    quiz = activities.Quiz("ch03")
    qs = quiz.questions
    choice = next(i for i, q in enumerate(qs) if q["kind"] == "choice")
    number = next(i for i, q in enumerate(qs) if q["kind"] == "number")
    right = next(c["text"] for c in qs[choice]["choices"] if c["correct"])
    wrong = next(c["text"] for c in qs[choice]["choices"] if not c["correct"])

    assert quiz.score() == (0, 0, len(qs))
    fb = quiz.answer(choice, wrong)
    assert fb.startswith("\u2718 Not quite.") and qs[choice]["explanation"][:40] in html.unescape(fb)
    assert f"See the section {qs[choice]['section']}" in fb
    fb = quiz.answer(choice, right)                       # a second try is right, but the score keeps the first
    assert fb.startswith("\u2714 Right.")
    assert quiz.score() == (0, 1, len(qs))

    assert quiz.answer(number, "not a number") == "Type a number."
    assert quiz.score() == (0, 1, len(qs))
    answer = qs[number]["answer"]
    fb = quiz.answer(number, f"{answer:g} {qs[number].get('unit', '')}")
    assert fb.startswith("\u2714 Right."), fb
    assert quiz.score() == (1, 2, len(qs))
    assert "Score: 1 / 5" in quiz.score_label.value

    # a click in the widget (a value change) goes through the same path as `answer`
    other = next(i for i, q in enumerate(qs) if q["kind"] == "choice" and i != choice)
    quiz.inputs[other].value = next(c["text"] for c in qs[other]["choices"] if c["correct"])
    assert quiz.feedback(other).startswith("\u2714 Right.") and quiz.score() == (2, 3, len(qs))


def test_a_wrong_number_gets_a_hint_and_a_second_try():
    """A first wrong number shows whether it was too high or too low (and the question's hint), not the answer;
    a second wrong one shows the answer and the explanation; the score keeps the first try."""
    quiz = activities.Quiz("ch03")
    n = next(i for i, q in enumerate(quiz.questions) if q["kind"] == "number")
    q = quiz.questions[n]
    answer, tol = q["answer"], q.get("tolerance", 0)
    shown = activities.inline_html(activities._correct_text(q))
    fb = quiz.answer(n, answer + tol + 10)
    assert fb.startswith("\u2718 Not yet: too high.") and "Try once more" in fb, fb
    assert shown not in quiz.feedbacks[n].value and q["explanation"][:30] not in html.unescape(fb)
    if q.get("hint"):
        assert html.unescape(activities.inline_html(q["hint"]))[:30] in html.unescape(quiz.feedbacks[n].value)
    fb = quiz.answer(n, answer - tol - 10)
    assert fb.startswith("\u2718 Not quite. The answer is"), fb
    assert q["explanation"][:30] in html.unescape(fb) and f"See the section {q['section']}" in fb
    assert quiz.score() == (0, 1, len(quiz.questions))

    quiz = activities.Quiz("ch03")                          # too low, then right
    assert quiz.answer(n, answer - tol - 10).startswith("\u2718 Not yet: too low.")
    assert quiz.answer(n, answer).startswith("\u2714 Right.")
    assert quiz.score() == (0, 1, len(quiz.questions))

    quiz = activities.Quiz("ch03")                          # a question's own hint is shown with the direction
    quiz.questions = [dict(x, hint="Count the **blocks**, not the tokens.") if i == n else x
                      for i, x in enumerate(quiz.questions)]
    quiz.answer(n, answer + tol + 10)
    assert "Hint: Count the <b>blocks</b>, not the tokens." in quiz.feedbacks[n].value
    data = json.loads(json.dumps(activities.load("ch03")))
    data["quiz"][n]["hint"] = ""
    data["quiz"][next(i for i, x in enumerate(data["quiz"]) if x["kind"] == "choice")]["hint"] = "x"
    problems = "\n".join(activities.validate(data))
    assert "hint must be a non-empty string" in problems and "only a number question has a hint" in problems


def test_number_answers_parse_and_tolerance():
    assert activities.parse_number("3 KiB") == 3.0
    assert activities.parse_number("374,750") == 374750.0
    assert activities.parse_number("1.5e3") == 1500.0
    assert activities.parse_number("-0.25") == -0.25
    assert activities.parse_number("none") is None
    quiz = activities.Quiz("ch01")
    i = next(i for i, q in enumerate(quiz.questions) if q["id"] == "token-forwards")
    assert quiz.is_right(i, "374750") and quiz.is_right(i, 374750) and not quiz.is_right(i, "374751")


def test_score_and_recap_rating_update_live():
    quiz = activities.Quiz("ch05")
    rating = activities.RecapRating("ch05")
    board = activities.Scoreboard("ch05")
    assert "quiz 0/5" in board.label.value and "recap: not yet" in board.label.value
    q0 = quiz.questions[0]
    quiz.answer(0, next(c["text"] for c in q0["choices"] if c["correct"]))
    rating.buttons.value = "good"
    assert "quiz 1/5 right at the first try (1/5 answered)" in board.label.value
    assert "recap: good" in board.label.value and "Nothing leaves this notebook" in board.label.value


def test_widget_display_bundles_are_stable():
    quiz = activities.Quiz("ch02")
    bundle = quiz._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == quiz.widget.model_id
    assert bundle["text/plain"] == activities.Quiz("ch02")._repr_mimebundle_()["text/plain"]


@pytest.mark.parametrize("chapter", ALL_CHAPTERS)
def test_static_copy_shows_questions_and_folds_answers(chapter):
    data = activities.load(chapter)
    page = activities.quiz_static_html(chapter)
    text = activities.quiz_static_text(chapter)
    outside = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
    for q in data["quiz"]:
        assert activities.inline_html(q["question"]) in outside
        assert activities.inline_html(q["explanation"]) not in outside          # answers only when expanded
        assert activities.inline_html(q["explanation"]) in page
        assert activities._plain(q["question"]) in text and activities._plain(q["explanation"]) not in text
    assert page.count("<details>") == len(data["quiz"]) + sum(1 for q in data["quiz"] if q.get("hint"))
    recap = activities.recap_html(chapter)
    outside = re.sub(r"<details>.*?</details>", "", recap, flags=re.S)
    assert activities.inline_html(data["recap"]["answer"]) not in outside
    assert all(activities.inline_html(s) in recap for lvl in activities.LEVELS for s in data["recap"]["levels"][lvl])


# ----------------------------------------------------------------------------------- live references


def test_source_ref_lines_and_markers():
    import inspect

    from minirt.scheduler import Scheduler

    ref = activities.source_ref("minirt.scheduler.Scheduler.schedule")
    lines, start = inspect.getsourcelines(Scheduler.schedule)
    assert (ref.path, ref.start, ref.end) == ("minirt/scheduler.py", start, start + len(lines) - 1)
    assert str(ref) == f"minirt/scheduler.py lines {start}\u2013{start + len(lines) - 1}"
    assert "minirt/scheduler.py" in ref._repr_markdown_()
    loop = activities.source_ref("minirt.scheduler.Scheduler.schedule", marker="while (self.waiting_queue")
    assert start < loop.start < loop.end <= ref.end
    assert loop.lines[0].strip().startswith("while (self.waiting_queue") and "budget -= n" in loop.lines[-1]
    assert activities.source_ref("minirt.scheduler.Scheduler.waiting_queue").name.endswith("waiting_queue")
    with pytest.raises(LookupError, match="no attribute 'no_such_method'"):
        activities.source_ref("minirt.scheduler.Scheduler.no_such_method")
    with pytest.raises(LookupError, match="marker"):
        activities.source_ref("minirt.scheduler.Scheduler.schedule", marker="this text is not there")
    with pytest.raises(LookupError):
        activities.resolve("minirt.no_such_module.thing")


def test_definition_source_matches_inspect(tmp_path):
    """Oracle: `inspect.getsource` of the same objects in pure-Python modules (decorators included), and the
    exact lines of a file written here; a missing name raises LookupError naming it."""
    import inspect

    from minirt import scheduler
    from minirt.course import workloads

    assert activities.definition_source(scheduler.__file__, "split_budget") == inspect.getsource(scheduler.split_budget)
    assert activities.definition_source("minirt/scheduler.py", "Scheduler") == inspect.getsource(scheduler.Scheduler)
    assert (activities.definition_source(workloads.__file__, "count_ops")
            == inspect.getsource(workloads.count_ops))                           # its @contextmanager line too
    assert activities.definition_source(workloads.__file__, "count_ops").startswith("@contextlib.contextmanager")
    both = activities.definition_source(scheduler.__file__, "Scheduler", "split_budget")
    assert both == inspect.getsource(scheduler.Scheduler) + "\n" + inspect.getsource(scheduler.split_budget)
    module = tmp_path / "kernels.py"
    table = "TABLE: tuple[int, ...] = (\n    1,  # one\n    2,\n)\n"
    body = "@decorate(x=1)\n@other\ndef kernel(a,\n           b):\n    return a  # why\n"
    module.write_text("import nothing_importable\n\n" + table + "\n\n" + body + "\nX = Y = 3\n")
    assert activities.definition_source(module, "TABLE") == table
    assert activities.definition_source(module, "kernel") == body
    assert activities.definition_source(str(module), "Y") == "X = Y = 3\n"
    with pytest.raises(LookupError, match="'no_such_kernel'"):
        activities.definition_source(module, "kernel", "no_such_kernel")
    with pytest.raises(ValueError, match="names"):
        activities.definition_source(module)


NAME = re.compile(r"(?<![\w.])minirt(?:\.[A-Za-z_]\w*)+")
REF_CALLS = {"source_ref", "show_source"}
ACTIVITY_CALLS = {"quiz", "treasure_hunt", "recap", "score"}


def _code_for_ast(source: str) -> str:
    """Cell source without IPython-only lines (magics, shell escapes, `obj??`)."""
    keep = []
    for line in source.splitlines():
        s = line.strip()
        keep.append("" if s.startswith(("%", "!")) or s.endswith("?") else line)
    return "\n".join(keep)


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def chapter_references(path: Path) -> list[tuple[str, str | None, str | None, str]]:
    """(dotted name, marker, end_marker, where) for every reference to the package in a notebook."""
    refs, imported = [], {}          # imported: local name -> dotted name, across cells (one kernel)
    nb = nbformat.read(path, as_version=4)
    for k, cell in enumerate(nb.cells):
        where = f"{path.name} cell {k}"
        refs += [(m.group(0).removesuffix(".py"), None, None, where) for m in NAME.finditer(cell.source)]
        if cell.cell_type != "code":
            continue
        tree = compile(_code_for_ast(cell.source), where, "exec",
                       flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "minirt":
                        imported[a.asname or a.name.split(".")[0]] = a.name if a.asname else "minirt"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minirt":
                for a in node.names:
                    imported[a.asname or a.name] = f"{node.module}.{a.name}"
                    refs.append((f"{node.module}.{a.name}", None, None, where))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.Name)):
                parts = _dotted(node)
                if parts and parts[0] in imported and parts[0] != "minirt":
                    refs.append((".".join([imported[parts[0]], *parts[1:]]), None, None, where))
            if isinstance(node, ast.Call):
                fn = _dotted(node.func)
                if not fn:
                    continue
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                kw = {a.arg: a.value.value for a in node.keywords if isinstance(a.value, ast.Constant)}
                if fn[-1] in REF_CALLS and args:
                    marker = args[1] if len(args) > 1 else kw.get("marker")
                    end = args[2] if len(args) > 2 else kw.get("end_marker")
                    refs.append((args[0], marker, end, where))
                if fn[-1] in ACTIVITY_CALLS and fn[0] == "activities" and args:
                    assert activities.chapter_id(args[0]) == activities.chapter_id(path.name), \
                        f"{where}: shows the activities of {args[0]!r}"
    return refs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_symbol_a_chapter_names_exists(path):
    refs = chapter_references(path)
    assert refs, f"{path.name}: no references to the package found (scanner broken?)"
    broken = []
    for name, marker, end, where in refs:
        try:
            if marker is None and end is None:
                activities.resolve(name)
            else:
                activities.source_ref(name, marker, end)
        except (LookupError, ImportError) as e:
            broken.append(f"{where}: {e}")
    assert not broken, "stale references to minirt:\n" + "\n".join(sorted(set(broken)))


def test_reference_scanner_catches_a_renamed_symbol(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("See `minirt.scheduler.Scheduler.schedule_old`."),
                nbformat.v4.new_code_cell("from minirt.scheduler import Scheduler\nScheduler.try_alocate\n"
                                          "from minirt.course.activities import source_ref\n"
                                          "source_ref('minirt.engine.Engine.step', marker='no such line')")]
    path = tmp_path / "ch99_test.ipynb"
    nbformat.write(nb, path)
    bad = []
    for name, marker, end, where in chapter_references(path):
        try:
            activities.source_ref(name, marker, end) if marker else activities.resolve(name)
        except LookupError:
            bad.append(name)
    assert bad == ["minirt.scheduler.Scheduler.schedule_old", "minirt.scheduler.Scheduler.try_alocate",
                   "minirt.engine.Engine.step"], bad


# ----------------------------------------------------------------------------------- the tool


def _sample_notebook(path: Path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 04\n\n## Theory"), nbformat.v4.new_code_cell("x = 1")]
    for c in nb.cells:
        c.id = f"cell-{nb.cells.index(c)}"
    nbformat.write(nb, path)


def test_add_activities_is_idempotent_and_replaces(tmp_path):
    path = tmp_path / "ch04_prefix_cache.ipynb"
    _sample_notebook(path)
    assert add_activities.main([str(path)]) == 0
    first = path.read_text()
    nb = nbformat.read(path, as_version=4)
    marked = [c for c in nb.cells if add_activities.is_activity(c)]
    assert len(marked) == len(nb.cells) - 2 and nb.cells[-len(marked):] == marked     # appended at the end
    sources = [c.source for c in marked]
    assert 'activities.quiz("ch04")' in "".join(sources)
    assert add_activities.main([str(path)]) == 0
    assert path.read_text() == first                                                   # idempotent
    assert add_activities.main(["--check", str(path)]) == 0

    # an edited (stale) activity cell is replaced; outputs of unchanged cells are kept
    nb.cells[3].source = "activities.quiz('ch01')"
    nb.cells[5].outputs = [nbformat.v4.new_output("stream", text="kept\n")]
    nb.cells.append(nbformat.v4.new_markdown_cell("a note after the activities"))
    nbformat.write(nb, path)
    assert add_activities.main(["--check", str(path)]) == 1
    add_activities.main([str(path)])
    nb2 = nbformat.read(path, as_version=4)
    assert [c.source for c in nb2.cells if add_activities.is_activity(c)] == sources
    assert nb2.cells[5].outputs[0]["text"] == "kept\n"
    assert nb2.cells[-1].source == "a note after the activities"                      # replaced in place
    assert sum(add_activities.is_activity(c) for c in nb2.cells) == len(marked)

    add_activities.main(["--remove", str(path)])
    assert not any(add_activities.is_activity(c) for c in nbformat.read(path, as_version=4).cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_activities_are_current(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert any(add_activities.is_activity(c) for c in nb.cells), \
        f"{path.name} has no activities: run tools/add_activities.py {path.relative_to(ROOT)} and re-execute it"
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert not add_activities.process(copy, check=True), \
        f"{path.name}: activity cells are stale; run tools/add_activities.py and re-execute the notebook"
    assert add_activities.is_activity(nb.cells[-1]), f"{path.name}: the activities must end the chapter"
