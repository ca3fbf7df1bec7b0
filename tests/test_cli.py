"""`python -m minirt` entry points, run as a user would (subprocess)."""

import os
import subprocess
import sys



def _run(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "minirt", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_demo(default_model):
    proc = _run("demo", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "demo printed nothing"


def test_cli_generate(default_model):
    proc = _run("generate", "ROMEO:", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "generate printed nothing"


def test_cli_help():
    proc = _run("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "demo" in proc.stdout and "generate" in proc.stdout


def test_cli_bad_command_fails():
    proc = _run("no-such-command", timeout=120)
    assert proc.returncode != 0


def _assert_work_copy_of(copy, original):
    """Every cell as in the original but the first, which says it is the copy and links the chapter from there."""
    import json
    import re

    mine, theirs = (json.loads(p.read_text(encoding="utf-8")) for p in (copy, original))
    assert mine["cells"][1:] == theirs["cells"][1:] and mine["metadata"] == theirs["metadata"]
    first = "".join(mine["cells"][0]["source"])
    assert "This is your work copy" in first and "Work on a copy" not in first
    link = re.search(r"\]\(([^)]*chapters/ch03_[^)]+\.ipynb)\)", first)
    assert link and (copy.parent / link.group(1)).resolve() == \
        (original.parent.parent / "chapters" / link.group(1).rsplit("/", 1)[1]).resolve(), first


def test_exercise_start_copies_the_exercise_into_a_work_folder_and_never_overwrites_it(tmp_path):
    """`python -m minirt exercise start ex03 --dir D`: D/ex03_*.ipynb is exercises/' copy (its first cell
    says so and links the chapter from D); a second start keeps
    the student's edits (exit 2, naming the file) unless --force; an unknown exercise names the ones there are."""
    from pathlib import Path

    exercises = Path(__file__).resolve().parent.parent / "exercises"
    original = next(exercises.glob("ex03_*.ipynb"))
    work = tmp_path / "my-work"
    proc = _run("exercise", "start", "ex03", "--dir", str(work), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    copy = work / original.name
    assert str(copy) in proc.stdout
    _assert_work_copy_of(copy, original)
    copy.write_text("my edits")
    proc = _run("exercise", "start", "3", "--dir", str(work), timeout=120)
    assert proc.returncode == 2 and f"{copy} exists already" in proc.stderr
    assert copy.read_text() == "my edits"
    assert _run("exercise", "start", "ex03", "--dir", str(work), "--force", timeout=120).returncode == 0
    _assert_work_copy_of(copy, original)
    proc = _run("exercise", "start", "ex99", "--dir", str(work), timeout=120)
    assert proc.returncode == 2 and "no exercise 'ex99'" in proc.stderr and "ex01_naive_loop" in proc.stderr


def test_the_default_work_folder_and_venv_are_ignored_by_git():
    """Work copies in `work/` and a `.venv` made as the README says never show up as changes to the checkout."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "-C", str(root), "check-ignore", "work/ex03_paged_blocks.ipynb", ".venv/bin/python"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["work/ex03_paged_blocks.ipynb", ".venv/bin/python"], proc.stdout
