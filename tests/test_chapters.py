"""Notebook gates: every chapter re-runs from scratch, beside two CPU hogs, and reproduces its committed outputs.

Each chapter runs in its own `pytest --nbval` subprocess, so a kernel crash or a hang fails that chapter only.
Outputs that vary between runs (timings, progress bars, plots of timings) are marked `# NBVAL_IGNORE_OUTPUT` in
the notebooks; everything else must match exactly. Skipped when nbval or the embedded model is missing. About a
minute per chapter on a 2-core CPU, somewhat more with the hogs.

The hogs: a chapter must hold on a busy machine (a student's laptop with a browser and a build beside it, a shared
CI runner), so no chapter may assert on a timing. To keep it that way, every chapter runs while two busy Python
processes (`while True` loops at the same priority) compete with it for the CPU; on a 2-core machine that leaves
the notebook's kernel about two thirds of a core. The fixture checks that the hogs were alive for the whole run
and really burned CPU, and kills them afterwards, whatever the outcome. `MINIRT_CHAPTER_HOGS=N` sets how many
(0 runs the chapters on a quiet machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


CHAPTERS_DIR = Path(__file__).resolve().parent.parent / "chapters"
CHAPTERS = sorted(p.name for p in CHAPTERS_DIR.glob("ch[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 600
NUM_HOGS = int(os.environ.get("MINIRT_CHAPTER_HOGS", "2"))
#: A busy loop that also ends when its parent (this pytest process) is gone, even if teardown never runs.
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"

pytestmark = [
    pytest.mark.slow,
]


@pytest.fixture
def cpu_hogs():
    """`NUM_HOGS` busy processes beside the test; yields their Popen objects; kills them at teardown and
    checks that each was alive to the end and used at least a tenth of a core on average (two thirds of one
    on a 2-core machine running one notebook kernel beside them)."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL) for _ in range(NUM_HOGS)]
    start = time.monotonic()
    try:
        yield hogs
    finally:
        wall = time.monotonic() - start
        alive = [h.poll() is None for h in hogs]
        cpu = []
        for h, up in zip(hogs, alive):
            if not up:                                  # already reaped by poll(): no CPU time to read
                cpu.append(0.0)
                continue
            os.kill(h.pid, signal.SIGKILL)
            _, _, usage = os.wait4(h.pid, 0)            # the hog's own CPU time, from the kernel
            h.returncode = -signal.SIGKILL
            cpu.append(usage.ru_utime + usage.ru_stime)
    assert all(alive), f"a CPU hog died during the run: alive {alive}"
    assert all(c > 0.1 * wall for c in cpu), f"the hogs used {cpu} s of CPU in {wall:.0f} s: they did not compete"


def test_chapters_found():
    assert CHAPTERS, f"no chapter notebooks in {CHAPTERS_DIR}"


def test_hog_fixture_burns_cpu(cpu_hogs):
    """The hogs are running and busy (the fixture's teardown checks their CPU time)."""
    time.sleep(3.0)
    assert len(cpu_hogs) == NUM_HOGS and all(h.poll() is None for h in cpu_hogs)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_notebook(chapter, cpu_hogs):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
           f"--nbval-cell-timeout={TIMEOUT_S}", str(CHAPTERS_DIR / chapter)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, cwd=CHAPTERS_DIR.parent, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S * 2)
    assert proc.returncode == 0, (f"{chapter} failed nbval beside {len(cpu_hogs)} CPU hogs:\n"
                                  f"{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}")
