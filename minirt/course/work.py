"""`python -m minirt exercise start exNN [--dir DIR]`: a work copy of an exercise, outside the tracked tree.

Students solve a copy, never `exercises/` itself: that folder is generated from `solutions/` and the test suite
checks it is unchanged. The default folder, `work/` at the checkout's root, is ignored by git; the grader takes a
work copy as it is. The CLI pieces are `add_parser(subparsers)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

DEFAULT_WORK_DIR = "work"


def default_exercises_dir() -> Path:
    """`exercises/` next to the package (a source checkout, as the course is used)."""
    return Path(__file__).resolve().parent.parent.parent / "exercises"


def find_exercise(name: str, exercises_dir: Path) -> Path:
    """The notebook of exercise `name` ("ex03" or "03" or its file name). Raises ValueError naming the choices."""
    key = name.removesuffix(".ipynb")
    key = key if key.startswith("ex") else f"ex{key.zfill(2)}"
    found = sorted(p for p in exercises_dir.glob("ex[0-9][0-9]_*.ipynb") if p.stem == key or p.stem.startswith(key + "_"))
    if len(found) != 1:
        choices = ", ".join(p.stem for p in sorted(exercises_dir.glob("ex[0-9][0-9]_*.ipynb"))) or "none"
        raise ValueError(f"exercise: no exercise {name!r} in {exercises_dir} (there are: {choices})")
    return found[0]


def start(name: str, work_dir: Path, exercises_dir: Path | None = None, force: bool = False) -> Path:
    """Copy exercise `name` into `work_dir` (created) and return the copy's path. Raises FileExistsError if a copy
    is already there (a student's work is never overwritten unless `force`), ValueError for an unknown name."""
    source = find_exercise(name, exercises_dir or default_exercises_dir())
    work_dir.mkdir(parents=True, exist_ok=True)
    target = work_dir / source.name
    if target.exists() and not force:
        raise FileExistsError(f"exercise: {target} exists already (your work); open it, or pass --force to start over")
    nb = json.loads(source.read_text(encoding="utf-8"))
    nb["cells"][0]["source"] = as_work_copy("".join(nb["cells"][0]["source"]), source, target).splitlines(True)
    target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return target


def as_work_copy(text: str, source: Path, target: Path) -> str:
    """The exercise's first cell as the copy should read it: its "Work on a copy" paragraph says this is the
    copy, and its link to the chapter is relative to where the copy lives (any `--dir`)."""
    chapters = source.parent.parent / "chapters"
    rel = Path(os.path.relpath(chapters, target.parent.resolve())).as_posix()
    text = re.sub(r"\]\(\.\./chapters/", f"]({rel}/", text)
    return re.sub(r"\*\*Work on a copy\.\*\*.*?(?=\n\n|$)",
                  f"**This is your work copy** of `exercises/{source.name}` (the original, which stays unchanged); "
                  "solve the tasks here.", text, count=1, flags=re.S)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `exercise start` to an argparse subparsers object (`python -m minirt exercise start ex03`)."""
    p = subparsers.add_parser("exercise", help="start an exercise in a work folder that git ignores")
    actions = p.add_subparsers(dest="action", required=True)
    s = actions.add_parser("start", help="copy exercises/exNN_*.ipynb into a work folder and say what to open")
    s.add_argument("name", help="ex01 ... ex11 (or 1 ... 11)")
    s.add_argument("--dir", default=None, help=f"work folder (default: {DEFAULT_WORK_DIR}/ at the checkout's root)")
    s.add_argument("--force", action="store_true", help="overwrite a copy that is already there")
    return p


def run(args) -> int:
    """Run `exercise start`: print where the copy is; exit 2 with the reason on a bad name or an existing copy."""
    exercises_dir = default_exercises_dir()
    work_dir = Path(args.dir) if args.dir else exercises_dir.parent / DEFAULT_WORK_DIR
    try:
        target = start(args.name, work_dir, exercises_dir, args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {target}\nopen it in JupyterLab (`jupyter lab {target}`), solve each task, run its check cell;\n"
          f"check the whole notebook as the grader does: pytest --nbval --nbval-current-env {target}")
    return 0
