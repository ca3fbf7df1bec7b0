"""GPU kernels (optional): used on CUDA when Triton is importable; the torch code in `minirt.attention`
stays the reference they are tested against."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from minirt.attention import paged_attention_reference, store_kv
from minirt.config import ATTENTION_BACKENDS


def triton_missing(device: torch.device, head_dim: int | None = None) -> list[str]:
    """What the Triton kernel needs and does not have here (empty: it can run): a CUDA device, Triton, and a
    power-of-two head_dim >= 16 (not checked when head_dim is None)."""
    needs = [(f"a CUDA device (got {device.type})", device.type == "cuda"),
             ("Triton installed (it is not)", importlib.util.find_spec("triton") is not None)]
    if head_dim is not None:
        needs.append((f"a power-of-two head_dim >= 16 (got {head_dim})",
                      head_dim >= 16 and head_dim & (head_dim - 1) == 0))
    return [need for need, ok in needs if not ok]


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


def refuse_missing_triton(device: torch.device, attention_backend: str, gemv: bool | None,
                          head_dim: int | None = None, rotary_kernel: bool | None = None,
                          pdl: bool | None = None, kv_write_in_rotary: bool | None = None,
                          combine_in_attention: bool | None = None, prefetch_kv: bool | None = None,
                          l2_prefetch: bool | None = None) -> None:
    """Raise ValueError naming the field if a Triton switch is asked for explicitly (`attention_backend="triton"`,
    `gemv=True`, `rotary_kernel=True`, `pdl=True`, `kv_write_in_rotary=True`, `combine_in_attention=True`,
    `prefetch_kv=True`, `l2_prefetch=True`) and cannot run on `device`. Callable before any model is loaded:
    head_dim None skips its checks (the rotary kernel also needs a power-of-two head_dim)."""
    missing = triton_missing(device, head_dim)
    if missing and attention_backend == "triton":
        raise ValueError(f"attention_backend: 'triton' needs {' and '.join(missing)}")
    if missing and rotary_kernel:
        raise ValueError(f"rotary_kernel: the Triton kernel needs {' and '.join(missing)}")
    missing = triton_missing(device)
    for name, asked in (("kv_write_in_rotary", kv_write_in_rotary), ("combine_in_attention", combine_in_attention)):
        if missing and asked:
            raise ValueError(f"{name}: the Triton kernel it runs in needs {' and '.join(missing)}")
    if missing and gemv:
        raise ValueError(f"gemv: the Triton matrix-vector kernel needs {' and '.join(missing)}")
    if pdl and (missing := pdl_missing(device)):
        raise ValueError(f"pdl: programmatic dependent launch needs {' and '.join(missing)}")
    if prefetch_kv and (missing := pdl_missing(device)):
        raise ValueError(f"prefetch_kv: loads K/V before the wait of programmatic dependent launch, which needs "
                         f"{' and '.join(missing)}")
    if l2_prefetch and (missing := pdl_missing(device)):
        raise ValueError(f"l2_prefetch: the bulk prefetch into L2 needs {' and '.join(missing)}")


def select_paged_attention(backend: str, device: torch.device, head_dim: int, split_kv: bool = True):
    """The paged-attention kernel and K/V write for an engine, as `(attention_kernel, store)`: "torch"
    (`paged_attention_reference`, `store_kv`), "triton" (`paged_attention_triton`, `store_kv_triton`; needs
    CUDA, Triton and a power-of-two head_dim >= 16), or "auto" (triton where it can run, else torch).
    split_kv=False keeps the Triton kernel at one program per (sequence, KV head) (see its `num_splits`).
    Raises ValueError for an unknown name or a "triton" request that cannot run here."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    refuse_missing_triton(device, backend, None, head_dim)
    if backend == "torch" or triton_missing(device, head_dim):
        return paged_attention_reference, store_kv
    from minirt.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton

    kernel = paged_attention_triton if split_kv else functools.partial(paged_attention_triton, num_splits=1)
    return kernel, store_kv_triton
