"""CUDA C++ kernels built on first use: nvcc into a shared library that ctypes loads (the persistent GEMV chain of
`gemv_chain_cuda`, the decode attention of `decode_attention_cuda`, `lab/probes/sync_floor.py`)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minirt.kernels import capability_missing


def nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc, else the one on the PATH (None: neither)."""
    home = os.environ.get("CUDA_HOME")
    if home and Path(home, "bin", "nvcc").is_file():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


def hopper_nvcc_missing(device: torch.device) -> list[str]:
    """What a Hopper kernel built here needs and does not have (empty: it can run): a CUDA device of compute
    capability 9.0 or later, and nvcc to build it (CUDA_HOME or on the PATH)."""
    missing = capability_missing(device, 9)
    if device.type != "cuda":
        return missing
    if nvcc() is None:
        missing.append("nvcc (CUDA_HOME or on the PATH) to build the kernel")
    return missing


def build_library(source: Path, flags: list[str], name: str) -> ctypes.CDLL:
    """`source` (CUDA C++) built by nvcc with `flags` into a shared library and loaded with ctypes; cached under
    $MINIRT_CACHE (default ~/.cache/minirt) as `name-<hash of the source and flags>.so`, so a changed source or flag
    builds anew. Raises RuntimeError with nvcc's output if the build fails."""
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MINIRT_CACHE", Path.home() / ".cache" / "minirt"))
    path = cache / f"{name}-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:      # built aside, then renamed: no half-written file
            built = Path(tmp, path.name)
            cmd = [nvcc() or "nvcc", *flags, "-shared", "-Xcompiler", "-fPIC", "-o", str(built), str(source)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stdout}{done.stderr}")
            os.replace(built, path)
    return ctypes.CDLL(str(path))
