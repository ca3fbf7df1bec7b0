"""SwiGLU's `silu(gate) * up` as one Triton kernel over 2-D tiles of rows and channels.

`minirt.model.layers.silu_and_mul` is two elementwise kernels eagerly; `torch.compile` (`fused_ops`) makes it one,
but compiled with dynamic shapes (`minirt.fast.ops.fused`) that kernel indexes a flat range with a division by the
row length, a number it only learns at run time, and cannot prove its loads aligned, so it moves a prefill step's
gate and up (8,192 x 3,072 each for Qwen3-0.6B) at well under the copy bandwidth (measured by
`lab/probes/prefill_kernels.py`). Here the row length is a compile-time constant, a program takes a tile of rows x
channels, and the loads and stores of each row are contiguous. vLLM runs the same op as a custom kernel (`silu_and_mul`,
`SiluAndMul.forward_cuda`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.kernels.rotary_triton import _round


@triton.jit
def _silu_and_mul_kernel(Gate, Up, Out, num_rows, stride_g, stride_u, INTERMEDIATE: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    ok = (rows < num_rows) & (cols < INTERMEDIATE)
    rows = rows.to(tl.int64)
    g = tl.load(Gate + rows * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(Up + rows * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    # As eager torch: silu in float32 (x / (1 + exp(-x))), rounded to the dtype, then the product, rounded (by
    # `_round`, to nearest even, so that the store's own conversion is exact: Triton's interpreter truncates there).
    dt = Out.dtype.element_ty
    silu = _round(g / (1.0 + tl.exp(-g)), dt)
    tl.store(Out + rows * INTERMEDIATE + cols, _round(silu * u, dt).to(dt), mask=ok)


#: (rows, channels) per program: rows of 512 channels load as long contiguous runs, and a decode batch of a few hundred
#: rows still makes a few hundred programs (the sweep behind it: lab/probes/prefill_kernels.py).
BLOCK_ROWS, BLOCK_COLS, NUM_WARPS = 4, 512, 4


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor, *, block_rows: int = BLOCK_ROWS,
                        block_cols: int = BLOCK_COLS, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`minirt.model.layers.silu_and_mul` in one kernel: gate, up `[..., I]` (same shape and dtype, on one device;
    each row contiguous, rows evenly strided, as the two halves of a merged gate/up projection are) -> a new
    contiguous `[..., I]` in their dtype. Computes in float32 and rounds after the SiLU and after the product, as
    eager torch does. block_rows, block_cols and num_warps (powers of two): the tile of one program (benchmarks sweep
    them). Raises ValueError naming the argument for layouts it cannot read, or a tile that is not a power of two."""
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up: must be {gate.dtype} {tuple(gate.shape)} on {gate.device} like gate, "
                         f"got {up.dtype} {tuple(up.shape)} on {up.device}")
    for name, value in (("block_rows", block_rows), ("block_cols", block_cols), ("num_warps", num_warps)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}: must be a power of two, got {value!r}")
    intermediate = gate.shape[-1]
    num_rows = gate.numel() // intermediate if intermediate else 0
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if num_rows == 0:
        return out
    views = []
    for name, x in (("gate", gate), ("up", up)):
        try:
            view = x.view(num_rows, intermediate)
        except RuntimeError:
            view = None
        if view is None or view.stride(1) != 1:
            raise ValueError(f"{name}: each row's {intermediate} values must be contiguous and rows evenly strided, "
                             f"got strides {tuple(x.stride())}")
        views.append(view)
    g, u = views
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(intermediate, block_cols))
    _silu_and_mul_kernel[grid](g, u, out, num_rows, g.stride(0), u.stride(0), INTERMEDIATE=intermediate,
                               BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps)
    return out
