"""`python -m minirt` entry points, run as a user would (subprocess)."""

import os
import subprocess
import sys

import pytest



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


#: Runs the CLI in a fresh interpreter and records torch's thread count at every forward pass of the model: the
#: count in force where the work is done, not the one the command says it set.
THREAD_PROBE = """
import sys, torch, minirt.cli
from minirt.model.decoder import DecoderModel
seen, forward = [], DecoderModel.forward
def recording(self, *args, **kwargs):
    seen.append(torch.get_num_threads())
    return forward(self, *args, **kwargs)
DecoderModel.forward = recording
rc = minirt.cli.main(sys.argv[1:])
print(f"FORWARD THREADS {sorted(set(seen))} {len(seen)}", file=sys.stderr)
sys.exit(rc)
"""
_probed = {}


def _probe(*args, omp=None):
    """(stdout, stderr, thread counts seen by the model's forward) of `python -m minirt ARGS`, cached."""
    import re

    key = (args, omp)
    if key not in _probed:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **({"OMP_NUM_THREADS": omp} if omp else {}))
        proc = subprocess.run([sys.executable, "-c", THREAD_PROBE, *args], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        m = re.search(r"FORWARD THREADS \[([0-9, ]*)\] ([0-9]+)", proc.stderr)
        assert m and int(m.group(2)) > 0, proc.stderr[-2000:]
        _probed[key] = proc.stdout, proc.stderr, [int(n) for n in m.group(1).split(",")]
    return _probed[key]


DEMO = ("demo", "--num-prompts", "2", "--max-new-tokens", "4")
GENERATE = ("generate", "ROMEO:", "--max-new-tokens", "4")


@pytest.mark.parametrize("command", [DEMO, GENERATE], ids=["demo", "generate"])
def test_threads_flag_is_the_thread_count_of_the_run(default_model, command):
    """`--threads 3` (more than this machine may have, so it is not torch's default by chance): every forward pass
    runs with torch.get_num_threads() == 3, and the command says so."""
    out, err, seen = _probe(*command, "--threads", "3")
    assert seen == [3]
    assert "3 CPU threads" in out + err


def test_generate_defaults_to_one_thread_for_the_embedded_model_unless_omp_says_otherwise(default_model):
    """Without --threads the embedded model runs on one thread (measured fastest: benchmarks/results/cpu/
    threads.json), whatever torch's default; OMP_NUM_THREADS, when set, is what the user asked for and wins."""
    assert _probe(*GENERATE)[2] == [1]
    assert _probe(*GENERATE, omp="2")[2] == [2]
    proc = _run(*GENERATE, "--threads", "0", timeout=120)
    assert proc.returncode == 2 and "--threads: must be >= 1, got 0" in proc.stderr


@pytest.mark.parametrize("command", [DEMO, GENERATE], ids=["demo", "generate"])
def test_ttft_and_tpot_are_defined_where_they_are_first_printed(default_model, command):
    """The legend line comes once, before the first line that shows a TTFT or TPOT figure, on the same stream."""
    from minirt.cli import LEGEND

    out, err, _ = _probe(*command, "--threads", "3")
    stream = out if command is DEMO else err
    lines = stream.splitlines()
    assert lines.count(LEGEND) == 1, stream[-2000:]
    first = next(i for i, line in enumerate(lines) if ("TTFT" in line or "TPOT" in line) and line != LEGEND)
    assert lines.index(LEGEND) < first
    assert "TTFT = time to first token" in LEGEND and "TPOT = time per output token" in LEGEND
    assert "TTFT" not in (err if command is DEMO else out)        # nothing shows them on the other stream


def test_the_cli_parses_its_other_commands_without_the_serve_extra(monkeypatch, capsys):
    """`python -m minirt bench` (or generate, demo) on a machine without uvicorn/starlette: the serve command's
    limit flags are left out, the other commands parse as ever, and serve says what it needs."""
    import argparse

    from minirt import cli
    from minirt.serve import server

    monkeypatch.setitem(sys.modules, "minirt.serve.limits", None)      # its import fails, as without the extra
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "--quantization" in capsys.readouterr().out
    assert server.run(argparse.Namespace(command="serve")) == 2
    assert "serve needs the serve extra: pip install 'minirt[serve]'" in capsys.readouterr().err
