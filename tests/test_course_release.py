"""`python -m minirt course release DIR`: a student copy that holds no answer, in which a student runs a chapter and
checks an exercise as its README says.

Oracle of "no answer": the answers themselves. Every line of a solution region of `solutions/exNN_*.ipynb` and
every line of `solutions/answers/chNN.md` and of the instructor's guide is searched for in every text of the copy
(notebooks by their cells' sources and text outputs). Left out of the search are lines the checkout ships to
students anyway: those the exercise notebook itself holds (its signatures, its task text) and those in chapters/,
minirt/, lab/ and benchmarks/ (the package is the reference engine the chapters print and the checks compare
with; its quizzes' explanations are shown by the chapters after an answer; its student README shares set-up
lines with the guide). What is searched for is, then, exactly
what exists only in `solutions/`. Oracle of "the exercise checks work in the copy": the instructor's solution,
pasted into a work copy, passes nbval there, and the unsolved work copy fails it naming a task.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
BEGIN = re.compile(r"^[ \t]*### BEGIN SOLUTION[ \t]*$")
END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
MIN_CHARS = 16                # shorter lines (`return x`, `else:`) say nothing about where they come from
TEXT_MIMES = ("text/plain", "text/html", "text/markdown", "text/latex")
#: What a student copy holds by design, read from the instructor's checkout (not from what the release wrote).
SHIPPED_ANYWAY = ("chapters", "minirt", "lab", "benchmarks")

pytestmark = pytest.mark.skipif(not (SOLUTIONS / "answers").is_dir(), reason="needs the instructor's checkout")


def _env(copy: Path) -> dict:
    """A student's shell in the copy: its own minirt first on the path, no hub, no thread oversubscription."""
    return dict(os.environ, PYTHONPATH=str(copy), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env or _env(cwd), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("release") / "minirt-student"
    proc = _run(["-m", "minirt", "course", "release", str(target)], cwd=ROOT, env=_env(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _texts(path: Path):
    """The texts a reader of `path` sees: a notebook's cell sources and text outputs, any other file's text."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            yield "".join(cell["source"])
            for out in cell.get("outputs", []):
                yield "".join(out.get("text", ""))
                yield from ("".join(v) for k, v in out.get("data", {}).items() if k in TEXT_MIMES)
        return
    data = path.read_bytes()
    if b"\0" not in data[:8192]:
        yield data.decode("utf-8", "replace")


def _corpus(paths) -> str:
    return "\n".join(t for p in paths if p.is_file() for t in _texts(p))


def _solution_lines(notebook: Path) -> list[str]:
    """The stripped lines between the solution markers of a solution notebook's code cells."""
    lines, inside = [], False
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).split("\n"):
            if BEGIN.match(line) or END.match(line):
                inside = bool(BEGIN.match(line))
            elif inside:
                lines.append(line.strip())
    return lines


def answer_lines() -> dict[str, str]:
    """{distinctive line: the file of solutions/ it comes from}: the lines that exist only in solutions/."""
    shipped = _corpus(sorted(p for folder in SHIPPED_ANYWAY for p in (ROOT / folder).rglob("*")
                             if "__pycache__" not in p.parts))
    found = {}
    for notebook in sorted(SOLUTIONS.glob("ex[0-9][0-9]_*.ipynb")):
        exercise = _corpus([ROOT / "exercises" / notebook.name])
        for line in _solution_lines(notebook):
            if len(line) >= MIN_CHARS and line not in exercise and line not in shipped:
                found.setdefault(line, notebook.name)
    for md in sorted(SOLUTIONS.rglob("*.md")):
        for line in md.read_text(encoding="utf-8").split("\n"):
            line = line.strip()
            if len(line) >= MIN_CHARS and line not in shipped:
                found.setdefault(line, str(md.relative_to(ROOT)))
    return found


def leaked(copy: Path) -> dict[str, str]:
    """The answer lines that appear somewhere in the copy, with where they come from."""
    text = _corpus(sorted(copy.rglob("*")))
    return {line: origin for line, origin in answer_lines().items() if line in text}


def test_release_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = _run(["-m", "minirt", "course", "release", str(tmp_path)], cwd=ROOT, env=_env(ROOT), timeout=120)
    assert proc.returncode == 2 and f"{tmp_path} is not empty" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_the_copy_holds_the_course_and_none_of_the_instructors_files(copy):
    """Chapters, exercises (as generated), the package, a student README; no solutions/, no tools/, no test that
    reads solutions/, no file carrying a solution marker."""
    for name in ("chapters", "exercises"):
        assert sorted(p.name for p in (copy / name).glob("*.ipynb")) == \
            sorted(p.name for p in (ROOT / name).glob("*.ipynb")), name
    for nb in (ROOT / "exercises").glob("*.ipynb"):
        assert (copy / "exercises" / nb.name).read_bytes() == nb.read_bytes()
    assert (copy / "minirt" / "default_model" / "model.safetensors").is_file()
    assert not [p for p in copy.rglob("*") if p.name in ("solutions", "answers", "tools", ".ci")]
    assert not (copy / "solutions").exists() and not (copy / "scripts" / "grade_class.py").exists()
    tests = sorted(p.name for p in (copy / "tests").glob("test_*.py"))
    assert "test_engine.py" in tests and "test_cli.py" in tests
    assert not [t for t in tests if "solutions" in (copy / "tests" / t).read_text(encoding="utf-8")]
    assert not [p for p in copy.rglob("*") if p.is_file() and b"### BEGIN SOLUTION" in p.read_bytes()]
    readme = (copy / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# minirt — the course") and "solutions/" not in readme
    for needed in ('pip install -e ".[notebooks]"', "python -m minirt exercise start ex01",
                   "pytest --nbval --nbval-current-env work/ex01_naive_loop.ipynb", "chapters/ch00_setup.ipynb"):
        assert needed in readme, needed


def test_no_line_of_any_answer_reaches_the_copy(copy):
    """Every line that exists only in solutions/ (solution regions, answers/chNN.md, the guide) is absent."""
    needles = answer_lines()
    origins = set(needles.values())
    notebooks = sorted(SOLUTIONS.glob("ex[0-9][0-9]_*.ipynb"))
    assert notebooks and all(_solution_lines(nb) for nb in notebooks), "solution markers not found"
    # ex07's solution regions are the package's own code (capture sizes, the split-KV combine): nothing of them
    # exists only in solutions/; every other solution notebook has lines of its own.
    assert {nb.name for nb in notebooks} - {"ex07_making_it_fast.ipynb"} <= origins, sorted(origins)
    assert len(needles) > 200, f"too few answer lines to search for: {len(needles)}"
    assert {f"solutions/answers/{p.name}" for p in (SOLUTIONS / "answers").glob("*.md")} <= origins
    found = leaked(copy)
    assert not found, "answers in the student copy:\n" + "\n".join(f"{o}: {l}" for l, o in list(found.items())[:20])


def test_a_planted_answer_is_found(copy, tmp_path):
    """The search above can fail: a solution notebook or an answers file dropped into a copy is found."""
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(copy / "chapters", planted / "chapters")
    shutil.copy(SOLUTIONS / "ex02_kv_cache.ipynb", planted / "chapters" / "notes.ipynb")
    shutil.copy(SOLUTIONS / "answers" / "ch03.md", planted / "ch03-notes.md")
    origins = set(leaked(planted).values())
    assert {"ex02_kv_cache.ipynb", "solutions/answers/ch03.md"} <= origins, origins


def _fill_with_solution(work_copy: Path) -> None:
    """Paste the instructor's solution cells into a student's work copy (cells line up one to one)."""
    mine = json.loads(work_copy.read_text(encoding="utf-8"))
    theirs = json.loads((SOLUTIONS / work_copy.name).read_text(encoding="utf-8"))
    assert len(mine["cells"]) == len(theirs["cells"])
    for cell, solved in zip(mine["cells"], theirs["cells"]):
        if cell["cell_type"] == "code" and "NotImplementedError" in "".join(cell["source"]):
            cell["source"] = solved["source"]
    work_copy.write_text(json.dumps(mine, indent=1), encoding="utf-8")


def test_a_student_runs_a_chapter_and_checks_an_exercise_in_the_copy(copy, tmp_path):
    """In the copy, with its own minirt: chapter 00 runs top to bottom (nbclient); `exercise start ex01` writes
    work/ex01_naive_loop.ipynb, which fails nbval naming its unsolved task; the same notebook with the
    instructor's solution pasted in passes."""
    env = _env(copy)
    chapter = copy / "chapters" / "ch00_setup.ipynb"
    script = (
        "import sys, nbformat\nfrom nbclient import NotebookClient\n"
        f"nb = nbformat.read({str(chapter)!r}, as_version=4)\n"
        "nb.cells.append(nbformat.v4.new_code_cell('import minirt; print(minirt.__file__)'))\n"
        f"NotebookClient(nb, timeout=300, kernel_name='python3', resources={{'metadata': {{'path': {str(chapter.parent)!r}}}}}).execute()\n"
        "print('MINIRT', nb.cells[-1].outputs[0]['text'].strip())\n")
    proc = _run(["-c", script], cwd=copy, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"MINIRT {copy / 'minirt' / '__init__.py'}" in proc.stdout, proc.stdout[-500:]

    proc = _run(["-m", "minirt", "exercise", "start", "ex01"], cwd=copy, env=env, timeout=120)
    work_copy = copy / "work" / "ex01_naive_loop.ipynb"
    assert proc.returncode == 0 and str(work_copy) in proc.stdout, proc.stdout + proc.stderr
    nbval = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env"]
    proc = _run([*nbval, "work/ex01_naive_loop.ipynb"], cwd=copy, env=env, timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "ex01.greedy_next_token" in proc.stdout and "not implemented" in proc.stdout, proc.stdout[-3000:]

    solved = tmp_path / "ex01_naive_loop.ipynb"     # outside the copy, so that no answer lands in it
    solved.write_bytes(work_copy.read_bytes())
    _fill_with_solution(solved)
    proc = _run([*nbval, str(solved)], cwd=copy, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
