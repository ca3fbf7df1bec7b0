"""GPU kernels (optional): used on CUDA when Triton is importable; the torch code in `minirt.attention`
stays the reference they are tested against. Every module here is one a `minirt.fast` plan can select
(tests/test_packaging.py checks it); probe kernels measured and kept out of the engine live in lab/kernels/."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch


def triton_missing(device: torch.device, head_dim: int | None = None) -> list[str]:
    """What the Triton kernel needs and does not have here (empty: it can run): a CUDA device, Triton, and a
    power-of-two head_dim >= 16 (not checked when head_dim is None)."""
    needs = [(f"a CUDA device (got {device.type})", device.type == "cuda"),
             ("Triton installed (it is not)", importlib.util.find_spec("triton") is not None)]
    if head_dim is not None:
        needs.append((f"a power-of-two head_dim >= 16 (got {head_dim})",
                      head_dim >= 16 and head_dim & (head_dim - 1) == 0))
    return [need for need, ok in needs if not ok]


def capability_missing(device: torch.device, major_needed: int) -> list[str]:
    """What a kernel for compute capability `major_needed`.0 or later needs and `device` does not have (empty: it
    can run): a CUDA device, of that capability."""
    if device.type != "cuda":
        return [f"a CUDA device (got {device.type})"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return [] if major >= major_needed else [f"compute capability {major_needed}.0 or later (got {major}.{minor})"]


@functools.lru_cache(maxsize=None)
def pdl_missing(device: torch.device) -> tuple[str, ...]:
    """What programmatic dependent launch (PDL) needs and does not have here (empty: it can run): a CUDA
    device of compute capability 9.0 or later (Hopper), and a Triton with `tl.extra.cuda.gdc_wait`. Cached per
    device: `linear_gemv(pdl=True)` asks on every call."""
    missing = triton_missing(device)
    if missing:
        return tuple(missing)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        missing.append(f"compute capability 9.0 or later (got {major}.{minor})")
    if importlib.util.find_spec("triton.language.extra.cuda") is None or not hasattr(
            importlib.import_module("triton.language.extra.cuda"), "gdc_wait"):
        missing.append("a Triton with tl.extra.cuda.gdc_wait (3.3 or later)")
    return tuple(missing)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (what the kernels size their grids by); 1 elsewhere (Triton's
    interpreter on the CPU, where any grid will do)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
