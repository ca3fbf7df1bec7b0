"""The product describes what is and what was measured, never the order in which the work was done.

Oracle: git's own list of tracked files (`git ls-files`), each read whole, chapters' sources and outputs
included. Outside `lab/` (the laboratory, where dated experiment pages live), no file may name a numbered work
period or a tracker number: the story of the work belongs in commit bodies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# "session" or "issue", a space, a digit (case-blind).
FORBIDDEN = re.compile(r"\b(session|issue) [0-9]", re.IGNORECASE)


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def offending_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return []                                    # binary files (weights, images) carry no prose
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
            for n, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]


def test_the_pattern_finds_what_it_must():
    # (built at run time, so that this file does not contain what it forbids)
    assert FORBIDDEN.search("since Session" + " 6 (tried in sessions 4 and 5)")
    assert FORBIDDEN.search("the running log of issue" + " 23")
    assert not FORBIDDEN.search("a session of the course; issues are listed")


def test_no_work_periods_or_tracker_numbers_outside_the_lab():
    files = [p for p in tracked_files() if p.relative_to(ROOT).parts[0] != "lab"]
    assert len(files) > 50, "git listed too few files: the check would pass vacuously"
    hits = [line for path in files for line in offending_lines(path)]
    assert not hits, "numbered work periods or tracker numbers outside lab/:\n" + "\n".join(hits[:40])
