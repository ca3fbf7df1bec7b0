#!/usr/bin/env python3
"""Generate the student notebooks `exercises/exNN_*.ipynb` from `solutions/exNN_*.ipynb`.

    python tools/make_exercises.py            # write exercises/ (deterministic: same input, same bytes)
    python tools/make_exercises.py --check    # exit 1, naming the files, if exercises/ is not what it would write
    python tools/make_exercises.py --execute  # first re-run every solution notebook in place (nbclient), then write

`solutions/` is the single source of truth. In every code cell, the lines from `### BEGIN SOLUTION` to
`### END SOLUTION` (markers included) become one `raise NotImplementedError("write your solution here")`
at the marker's indentation; the function signatures and docstrings outside the markers stay. Outputs of
those cells are cleared. Every other cell keeps its outputs - above all the check cells
(metadata `{"minirt": {"task": ..., "points": ...}}`), whose stored `PASS exNN.task (k/k cases)` line is
what nbval compares a student's run against. Metadata is reduced to what the course uses.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION[ \t]*$")
END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
STUB = 'raise NotImplementedError("write your solution here")'
NOTEBOOK_METADATA = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}}
CELL_METADATA_KEYS = ("minirt", "tags")


class MarkerError(ValueError):
    pass


def strip_solutions(source: str, where: str = "") -> tuple[str, int]:
    """Replace each BEGIN/END SOLUTION region by the stub; returns (new source, regions replaced)."""
    out, inside, count = [], False, 0
    for lineno, line in enumerate(source.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            if inside:
                raise MarkerError(f"{where} line {lineno}: BEGIN SOLUTION inside another solution region")
            inside, count = True, count + 1
            out.append(m.group("indent") + STUB)
        elif END.match(line):
            if not inside:
                raise MarkerError(f"{where} line {lineno}: END SOLUTION without BEGIN SOLUTION")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out), count


def clean_notebook(nb) -> None:
    """Reduce metadata to the course's keys (in place): no timings, no widget state, no kernel versions."""
    nb.metadata = copy.deepcopy(NOTEBOOK_METADATA)
    for cell in nb.cells:
        cell.metadata = {k: cell.metadata[k] for k in CELL_METADATA_KEYS if k in cell.metadata}
        if cell.cell_type == "code":
            for out in cell.outputs:
                if "metadata" in out and not out["metadata"]:
                    out["metadata"] = {}


def make_exercise(solution) -> nbformat.NotebookNode:
    """The student notebook for one solution notebook."""
    nb = copy.deepcopy(solution)
    clean_notebook(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source, n = strip_solutions(cell.source, f"cell {i}")
        if n:
            cell.source = source
            cell.outputs = []
            cell.execution_count = None
    return nb


def dumps(nb) -> str:
    """Stable JSON (nbformat's sorted keys, one-space indent) with a final newline."""
    return nbformat.writes(nb, version=4) + "\n"


def graded_cells(nb) -> list[tuple[int, dict]]:
    """(cell index, {"task", "points"}) of every check cell."""
    return [(i, dict(c.metadata["minirt"])) for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and "task" in c.metadata.get("minirt", {})]


def execute_in_place(path: Path, timeout: int = 600) -> None:
    """Run a solution notebook top to bottom in a kernel of this Python, store its outputs, clean it."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from nbclient import NotebookClient

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3", language="python")

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())
    try:
        NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    clean_notebook(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "task" in cell.metadata.get("minirt", {}):
            text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
            if not text.startswith("PASS "):
                raise SystemExit(f"{path}: check cell {i} ({cell.metadata['minirt']['task']}) did not pass:\n{text}")
    path.write_text(dumps(nb))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    p.add_argument("--exercises", type=Path, default=ROOT / "exercises")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if exercises/ differs")
    p.add_argument("--execute", action="store_true", help="re-execute the solution notebooks in place first")
    args = p.parse_args(argv)

    solutions = sorted(args.solutions.glob("ex[0-9][0-9]_*.ipynb"))
    if not solutions:
        print(f"no solutions/exNN_*.ipynb under {args.solutions}", file=sys.stderr)
        return 2
    if args.execute and not args.check:
        for path in solutions:
            print(f"executing {path.name}", flush=True)
            execute_in_place(path)

    expected: dict[str, str] = {}
    for path in solutions:
        nb = nbformat.read(path, as_version=4)
        try:
            expected[path.name] = dumps(make_exercise(nb))
        except MarkerError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        if not graded_cells(nb):
            print(f"{path}: no graded check cell (metadata minirt.task)", file=sys.stderr)
            return 2

    if args.check:
        problems = []
        for name, text in expected.items():
            target = args.exercises / name
            if not target.exists():
                problems.append(f"{target}: missing")
            elif target.read_text() != text:
                problems.append(f"{target}: differs from what {args.solutions / name} generates")
        for extra in sorted(set(p.name for p in args.exercises.glob("ex*.ipynb")) - set(expected)):
            problems.append(f"{args.exercises / extra}: has no solution notebook")
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python tools/make_exercises.py", file=sys.stderr)
            return 1
        print(f"exercises/ is up to date ({len(expected)} notebooks)")
        return 0

    args.exercises.mkdir(parents=True, exist_ok=True)
    for name, text in expected.items():
        target = args.exercises / name
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
