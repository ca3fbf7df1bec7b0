"""`python -m minirt course release DIR`: the student copy of the course, without solutions or answers.

nbgrader's "release" step: from the instructor's checkout it writes a repository that students clone or unpack,
holding the chapters, the exercises (generated from `solutions/`, their solution regions already stubs), the
`minirt` package, the lab pages the chapters link to, the benchmark results they read, the tests that need no
solutions, and a student README (`minirt/course/student_readme.md`). It leaves out `solutions/` (the solved
notebooks, the instructor's guide and `solutions/answers/`), `tools/` (the notebook generators, which read
`solutions/`), the instructor's scripts and CI, and every test that reads `solutions/` or checks the full
checkout. The package keeps the grader and the checks: what they compare a student with is `minirt`'s own
reference engine, which the chapters print anyway; the quizzes' keys stay too (the chapters score their quizzes
as the student answers). The CLI pieces are `add_parser(subparsers)` and `run(args) -> int`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
README_TEMPLATE = Path(__file__).with_name("student_readme.md")
#: What the copy holds, relative to the checkout's root (folders whole, less the tests left out below).
SHIPPED = ("chapters", "exercises", "minirt", "tests", "lab", "benchmarks", "scripts/train_default_model.py",
           "pyproject.toml", "environment.yml", ".gitignore")
#: Tests that need none of `solutions/` but check the instructor's full checkout, with the reason.
CHECKOUT_TESTS = {
    "test_activities.py": "imports tools/add_activities.py, the chapters' authoring tool",
    "test_packaging.py": "checks the full checkout's README, CI script and packaging",
    "test_word_rule.py": "greps the tracked files of the project's own git history",
}
JUNK = re.compile(r"(^|/)(__pycache__|\.ipynb_checkpoints|\.pytest_cache|\.hypothesis|[^/]*\.egg-info)(/|$)|\.pyc$")
SOLUTION_MARKER = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*$", re.M)


def needs_solutions(test_source: str) -> bool:
    """A test reads the instructor's material when its source names `solutions` (the folder, the answers in it)."""
    return "solutions" in test_source


def left_out_test(path: Path) -> str | None:
    """Why the test file `path` stays out of the copy, or None when it goes in."""
    if path.name in CHECKOUT_TESTS:
        return CHECKOUT_TESTS[path.name]
    if path.suffix == ".py" and needs_solutions(path.read_text(encoding="utf-8")):
        return "reads solutions/"
    return None


def _listed(root: Path) -> list[str]:
    """Files under SHIPPED, as posix paths relative to `root`: git's tracked and not-ignored files in a git
    checkout (so a `work/` folder or a stray build never leaks), else every file but caches."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                              "--", *SHIPPED], capture_output=True, text=True, check=True).stdout
        names = sorted({n for n in out.split("\0") if n and (root / n).is_file()})
    else:
        names = sorted(p.relative_to(root).as_posix() for s in SHIPPED if (root / s).exists()
                       for p in ([root / s] if (root / s).is_file() else (root / s).rglob("*")) if p.is_file())
    return [n for n in names if not JUNK.search(n)]


def _title(notebook: Path) -> str:
    """The first markdown heading of a notebook, without its '#'s (the file's stem when there is none)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^#+\s+(.+)$", "".join(cell["source"]), re.M)
            if m:
                return m.group(1).strip()
    return notebook.stem


def course_table(root: Path) -> str:
    """The README's table: one row per chapter, with the exercise of the same number when there is one."""
    exercises = {p.name[2:4]: p for p in sorted((root / "exercises").glob("ex[0-9][0-9]_*.ipynb"))}
    rows = ["| chapter (read, run, quiz) | exercise (graded) |", "|---|---|"]
    for ch in sorted((root / "chapters").glob("ch[0-9][0-9]_*.ipynb")):
        ex = exercises.get(ch.name[2:4])
        rows.append(f"| [{_title(ch)}](chapters/{ch.name}) | "
                    + (f"[`{ex.stem}`](exercises/{ex.name})" if ex else "-") + " |")
    return "\n".join(rows)


def student_readme(root: Path) -> str:
    return README_TEMPLATE.read_text(encoding="utf-8").replace("{{COURSE_TABLE}}", course_table(root))


def release(target: Path, root: Path = ROOT) -> dict:
    """Write the student copy of the checkout `root` into `target` (created; it must be empty or absent).

    Returns {"files": [relative paths written], "left_out_tests": {name: reason}}. Raises FileExistsError for a
    `target` that holds anything, ValueError when `root` is not a course checkout (no chapters/ or exercises/)
    or when a file to be shipped carries a solution marker (exercises/ not generated from solutions/)."""
    target = Path(target)
    for folder in ("chapters", "exercises", "minirt"):
        if not (root / folder).is_dir():
            raise ValueError(f"course release: {root} is not a course checkout (no {folder}/)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"course release: {target} is not empty; give a new or empty folder")
    left_out = {}
    files = []
    for name in _listed(root):
        if name.startswith("tests/"):
            reason = left_out_test(root / name)
            if reason:
                left_out[name[len("tests/"):]] = reason
                continue
        if name.endswith((".py", ".ipynb", ".md")) and SOLUTION_MARKER.search((root / name).read_text(encoding="utf-8")):
            raise ValueError(f"course release: {name} carries a solution marker; run tools/make_exercises.py")
        files.append(name)
    if not any(f.startswith("exercises/") for f in files):
        raise ValueError(f"course release: no exercises under {root / 'exercises'}")
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target / name)
    (target / "README.md").write_text(student_readme(root), encoding="utf-8")
    return {"files": sorted(files + ["README.md"]), "left_out_tests": left_out}


def add_parser(subparsers):
    """Add `course release DIR` to an argparse subparsers object."""
    p = subparsers.add_parser("course", help="instructor's steps: release a student copy of the course")
    actions = p.add_subparsers(dest="action", required=True)
    r = actions.add_parser("release", help="write a student repository without solutions/ or answers into DIR")
    r.add_argument("dir", help="a new or empty folder")
    return p


def run(args) -> int:
    """Run `course release DIR`: say what was written and left out; exit 2 with the reason on a non-empty DIR."""
    try:
        report = release(Path(args.dir))
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tops = sorted({f.split("/", 1)[0] for f in report["files"]})
    print(f"wrote {len(report['files'])} files to {args.dir}: {', '.join(tops)}")
    print("left out: solutions/ (solved notebooks, instructor's guide, answers/), tools/, the instructor's "
          "scripts, .ci/, and the tests " + ", ".join(sorted(report["left_out_tests"])))
    print(f"students start with {Path(args.dir) / 'README.md'}")
    return 0
