"""Notebook gates: every chapter re-runs from scratch and reproduces its committed outputs (nbval).

Each chapter runs in its own `pytest --nbval` subprocess, so a kernel crash or a hang fails that
chapter only. Outputs that vary between runs (timings, progress bars, plots of timings) are marked
`# NBVAL_IGNORE_OUTPUT` in the notebooks; everything else must match exactly. Skipped when nbval or
the embedded model is missing. About a minute per chapter on a 2-core CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


CHAPTERS_DIR = Path(__file__).resolve().parent.parent / "chapters"
CHAPTERS = sorted(p.name for p in CHAPTERS_DIR.glob("ch[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 600

pytestmark = [
    pytest.mark.slow,
]


def test_chapters_found():
    assert CHAPTERS, f"no chapter notebooks in {CHAPTERS_DIR}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_notebook(chapter):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
           f"--nbval-cell-timeout={TIMEOUT_S}", str(CHAPTERS_DIR / chapter)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, cwd=CHAPTERS_DIR.parent, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S * 2)
    assert proc.returncode == 0, f"{chapter} failed nbval:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
