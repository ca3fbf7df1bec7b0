#!/usr/bin/env python3
"""Append the standard self-check activities to a chapter notebook (or replace them if already there).

    python tools/add_activities.py chapters/ch05_asyncio_engine.ipynb [more notebooks...]
    python tools/add_activities.py --check chapters/ch0*.ipynb    # exit 1 if a notebook would change
    python tools/add_activities.py --remove chapters/ch05_asyncio_engine.ipynb

The chapter id comes from the file name (`chNN_...`); its data file `minirt/course/quizzes/chNN.json`
must exist and be well formed. The activity cells carry the metadata `{"minirt": {"activities": true}}`
and fixed ids (`activities-chNN-k`): a second run finds them, removes them and puts the standard cells
back at the same place (the end of the notebook on the first run). A cell whose type and source are
unchanged keeps its outputs, so re-running the tool on an executed notebook changes nothing. New
cells have no outputs: execute the notebook afterwards, e.g.

    jupyter nbconvert --to notebook --execute --inplace chapters/ch05_asyncio_engine.ipynb
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minirt.course import activities  # noqa: E402

MARK = {"minirt": {"activities": True}}


def activity_cells(chapter: str) -> list:
    """The standard activity cells of a chapter (markdown and code), with fixed ids and the marker metadata."""
    v4 = nbformat.v4
    c = f'"{chapter}"'
    specs = [
        ("markdown",
         "## Self-check\n\n"
         "Four activities close the chapter: a closed-book quiz, a treasure hunt in the reference source, a recap "
         "card and your score. They run in this notebook only; nothing is sent anywhere. On a rendered page "
         "(HTML) the questions are shown as text, with the answers folded.\n\n"
         "### Quiz\n\n"
         "Answer from memory first. Each answer says whether it is right and explains why, with a link back to "
         "the section; the score counts your first answers."),
        ("code", f"from minirt.course import activities\n\nactivities.quiz({c})"),
        ("markdown",
         "### Code treasure hunt\n\n"
         "Find each answer in the source of `minirt` (the file browser, or `??` on a function) before you open it. "
         "The answers show the exact lines they refer to, read from the package when this cell runs."),
        ("code", f"activities.treasure_hunt({c})"),
        ("markdown",
         "### Recap card\n\n"
         "Explain the chapter in 30 seconds, out loud or on paper. Then open the card, compare, and rate "
         "yourself against the pass / good / excellent criteria."),
        ("code", f"activities.recap({c})"),
        ("markdown", "### Score"),
        ("code", f"activities.score({c})"),
    ]
    cells = []
    for k, (kind, source) in enumerate(specs):
        cell = v4.new_markdown_cell(source) if kind == "markdown" else v4.new_code_cell(source)
        cell.id = f"activities-{chapter}-{k}"
        cell.metadata = nbformat.from_dict(MARK)
        cells.append(cell)
    return cells


def is_activity(cell) -> bool:
    return bool(cell.get("metadata", {}).get("minirt", {}).get("activities"))


def update(nb, chapter: str, remove: bool = False):
    """Return a new list of cells: the old activity cells replaced by the standard ones (or removed)."""
    old = {cell.get("id"): cell for cell in nb.cells if is_activity(cell)}
    first = next((i for i, cell in enumerate(nb.cells) if is_activity(cell)), None)
    kept = [cell for cell in nb.cells if not is_activity(cell)]
    if remove:
        return kept
    new = []
    for cell in activity_cells(chapter):
        prev = old.get(cell.id)
        if prev is not None and prev.cell_type == cell.cell_type and prev.source == cell.source:
            prev.metadata["minirt"] = nbformat.from_dict(MARK["minirt"])
            new.append(prev)               # unchanged: keep its outputs
        else:
            new.append(cell)
    at = len(kept) if first is None else first
    return kept[:at] + new + kept[at:]


def process(path: Path, check: bool = False, remove: bool = False) -> bool:
    """Update one notebook in place; returns True if it changed (or, with check, would change)."""
    chapter = activities.chapter_id(path.name)
    if not remove:
        problems = activities.validate(activities.load(chapter))
        if problems:
            raise SystemExit(f"{activities.quiz_path(chapter)} is not well formed:\n  " + "\n  ".join(problems))
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    nb.cells = update(nb, chapter, remove)
    after = nbformat.writes(nb)
    changed = before != after
    if changed and not check:
        nbformat.validate(nb)
        path.write_text(after, encoding="utf-8")
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    ap.add_argument("--remove", action="store_true", help="remove the activity cells instead")
    args = ap.parse_args(argv)
    stale = []
    for path in args.notebooks:
        changed = process(path, check=args.check, remove=args.remove)
        verb = ("would change" if args.check else "updated") if changed else "unchanged"
        print(f"{path}: {verb}")
        if changed:
            stale.append(path)
    if stale and not args.check:
        print("execute the changed notebooks, e.g.: jupyter nbconvert --to notebook --execute --inplace "
              + " ".join(map(str, stale)))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
