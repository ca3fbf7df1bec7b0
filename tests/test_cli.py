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
