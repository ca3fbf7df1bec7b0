"""A copy kernel launched with PDL that spins before it writes (`tests/pdl_writer.py`'s `spin_before_writing`): the
kernel before a probe kernel in the lab's PDL tests, still running long after that kernel has started."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:     # no Triton: the PDL tests skip before they get here
    triton = None
else:
    from pdl_writer import spin_before_writing

    @triton.jit
    def _slow_copy_kernel(Src, Dst, N, SPIN_NS: tl.constexpr, BLOCK: tl.constexpr):
        spin_before_writing(SPIN_NS)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Dst + offs, tl.load(Src + offs, mask=offs < N), mask=offs < N)


def slow_copy(src: torch.Tensor, dst: torch.Tensor, spin_ns: int = 1_000_000) -> None:
    """`dst.copy_(src)` (contiguous CUDA tensors of one dtype and size) by a kernel launched with PDL that spins
    spin_ns nanoseconds first: the next kernel, launched with PDL, starts while this one spins."""
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.numel() == dst.numel()
    _slow_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), SPIN_NS=spin_ns, BLOCK=1024,
                                                         launch_pdl=True)
