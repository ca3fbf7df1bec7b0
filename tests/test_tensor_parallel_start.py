"""Tensor parallelism, how the ranks start: each rank is a clean interpreter running the rank's own entry point
(`python -m minirt.parallel.rank`), never the parent's main module. So two ranks start, and print one process's
greedy tokens, from a script without an `if __name__ == "__main__":` guard, from standard input (`python -`), from
`python -c` and from a notebook kernel; a rank that fails to start is named with its own error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import minirt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "ROMEO:"
N = 8
CODE = textwrap.dedent(f"""\
    import minirt
    llm = minirt.LLM(minirt.DEFAULT_MODEL, device="cpu", dtype="float32", tensor_parallel_size=2)
    out = llm.generate([{PROMPT!r}], minirt.SamplingParams(max_new_tokens={N}))
    print("TOKENS", out[0].token_ids, flush=True)
    """)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def expected(default_llm) -> str:
    """The line the code prints, from one process."""
    out = default_llm.generate([PROMPT], minirt.SamplingParams(max_new_tokens=N))
    return f"TOKENS {out[0].token_ids}"


def run(args, tmp_path, path=(), **kwargs) -> subprocess.CompletedProcess:
    """`python *args` in `tmp_path`, with `path` then this checkout first on PYTHONPATH (the ranks inherit it)."""
    pythonpath = os.pathsep.join([*map(str, path), ROOT, os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": pythonpath}, **kwargs)


def check(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout.splitlines(), (proc.stdout, proc.stderr[-3000:])


def test_from_a_script_without_a_main_guard(tmp_path, expected):
    (tmp_path / "script.py").write_text(CODE)
    check(run(["script.py"], tmp_path), expected)


def test_from_standard_input(tmp_path, expected):
    check(run(["-"], tmp_path, input=CODE), expected)


def test_from_python_c(tmp_path, expected):
    check(run(["-c", CODE], tmp_path), expected)


def test_from_a_notebook_kernel(tmp_path, expected):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CODE)])
    path = tmp_path / "start.ipynb"
    nbformat.write(nb, path)
    # nbclient in a child process: the kernel inherits its environment (this checkout first on the path)
    driver = textwrap.dedent(f"""\
        import nbclient, nbformat
        nb = nbformat.read({str(path)!r}, as_version=4)
        nbclient.NotebookClient(nb, timeout={TIMEOUT_S}, kernel_name="python3").execute()
        for out in nb.cells[0].outputs:
            print(out.get("text", ""), end="")
        """)
    check(run(["-c", driver], tmp_path), expected)


FAIL = """\
import importlib, sys
if "minirt.parallel.rank" in sys.orig_argv:          # in a rank only: replace {target} by a function that raises
    def fail(*args, **kwargs):
        raise RuntimeError("a test asked this rank to fail")
    module, name = {target!r}.rsplit(".", 1)
    setattr(importlib.import_module(module), name, fail)
"""


@pytest.mark.parametrize("target", ["minirt.parallel.runner.build_rank_runner",    # raised inside the rank's handler
                                    "minirt.parallel.workers.rank_main"])          # uncaught: its stderr's last line
def test_a_rank_that_fails_to_start_is_named_with_its_own_error(tmp_path, target):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAIL.format(target=target))
    proc = run(["-c", CODE], tmp_path, path=[tmp_path / "site"])
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]                 # torch.distributed prefixes it with "[rank0]: "
    assert "RuntimeError: tensor_parallel_size: the ranks did not start" in last, proc.stderr[-3000:]
    assert "rank 1: RuntimeError: a test asked this rank to fail" in last, last
