"""The lab's probe scripts run as their docstrings say (`python lab/probes/NAME.py`, from any folder, nothing on
PYTHONPATH): they find minirt, lab and benchmarks/ by their own sys.path, and without CUDA they exit with status 2
and a message naming CUDA, not a traceback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBES = Path(__file__).resolve().parents[1] / "probes"
NAMES = ["combine_o_proj_probe", "decode_attention", "gemv", "sync_floor"]
NEEDS_TRITON_AT_IMPORT = {"combine_o_proj_probe", "decode_attention"}   # the Triton kernels they import or define


def test_the_probes_named_exist():
    assert set(NAMES) <= {p.stem for p in PROBES.glob("*.py")}


@pytest.mark.parametrize("name", NAMES)
def test_probe_exits_2_without_cuda(name, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the probe runs for real on CUDA")
    if name in NEEDS_TRITON_AT_IMPORT and importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(PROBES / f"{name}.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cuda" in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr[-2000:]
