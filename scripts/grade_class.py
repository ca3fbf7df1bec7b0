"""Time `python -m minirt grade` on a class of N copies of one solution notebook (default: 30 of ex06).

    python scripts/grade_class.py [--n 30] [--exercise ex06] [--jobs 1] [--sandbox auto]

Prints the wall-clock seconds of the whole run and per submission. Run it from a checkout (the grader reads
its solutions/); to time an older grader, run this script with PYTHONPATH pointing at that checkout.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--exercise", default="ex06")
    p.add_argument("--jobs", type=int, default=None, help="passed as --jobs when given")
    p.add_argument("--sandbox", default=None, help="passed as --sandbox when given")
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the checkout to grade with")
    args = p.parse_args(argv)
    root = Path(args.root)
    solution = next((root / "solutions").glob(f"{args.exercise}_*.ipynb"))
    work = Path(tempfile.mkdtemp(prefix="grade-class-"))
    try:
        subs = []
        for i in range(args.n):
            subs.append(work / f"student{i:02d}_{solution.name}")
            shutil.copyfile(solution, subs[-1])
        cmd = [sys.executable, "-m", "minirt", "grade", *map(str, subs), "--out", str(work / "grades.csv")]
        cmd += ["--jobs", str(args.jobs)] if args.jobs else []
        cmd += ["--sandbox", args.sandbox] if args.sandbox else []
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return 1
        print(f"{args.n} submissions of {args.exercise}: {seconds:.1f} s ({seconds / args.n:.2f} s each)"
              + (f", jobs={args.jobs}" if args.jobs else "") + (f", sandbox={args.sandbox}" if args.sandbox else ""))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
