"""Matrix products with quantized weights for many rows (prefill, large decode batches): `x @ dequantize(q, scale).T`
on the matrix units, in Triton.

Past a few rows the GEMV (`minirt.kernels.quant_gemv_triton`) runs out of arithmetic: it multiplies on the vector
units, so its time grows with the rows while a GEMM's barely moves until the matrix units are busy. The two ways
around it that need no new kernel both pay for the quantization: dequantize-then-cuBLAS writes and reads a bf16 copy
of the weight (three times its bytes), and `torch._scaled_mm` rounds the activations to FP8 on every call. Here each
program owns a `[BLOCK_M, BLOCK_N]` tile of the output. It walks K in BLOCK_K steps, loading a `[BLOCK_M, BLOCK_K]`
tile of x and a `[BLOCK_K, BLOCK_N]` tile of q (one byte per element, contiguous along K), converts the weights in
registers to x's dtype and multiplies the two with `tl.dot`, accumulating in float32. The conversion is exact: int8
values (|v| <= 127) and every e4m3 value are bfloat16, float16 and float32 numbers. The scales stay out of the
main loop's products:

* per output channel (`scale [N]`): `y[m, n] = scale[n] * sum_k x[m, k] q[n, k]`, one multiply in the epilogue;
* per B x B block (`scale [ceil(N/B), ceil(K/B)]`): BLOCK_K divides B, so a step's columns lie in one block column
  and its partial `tl.dot` takes one scale per output column before it is added. Partial edge blocks need only
  the masks. When B has no power-of-two divisor of 16 or more (the smallest `tl.dot` step), or an explicit config's
  BLOCK_K does not divide B, the scales multiply the weight tile before the dot instead, element by element in
  float32 as `dequantize` does (then rounded to x's dtype: exact for float32 x).

float32 x is multiplied at full precision (`input_precision="ieee"`, not TF32's 10-bit mantissa), bfloat16 and
float16 x in their own dtype. This is the W8A16 scheme of Marlin (Frantar et al. 2024, "MARLIN: Mixed-Precision
Auto-Regressive Parallel Inference on Large Language Models": 4-bit weights there, converted in registers to feed
the tensor cores) and of vLLM's fused-MoE Triton kernel: its `use_int8_w8a16` path (`tl.dot(a, b.to(compute_type))`,
the channel scale after the loop, as `triton_scaled_mm`'s epilogue) and its block-scaled FP8 path (each step's
partial dot times its block's scale), in the plain form of one output tile per program.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minirt.kernels.quant_gemv_triton import check_quant_args, rows_of

# First guesses, to be swept on the GPU (lab/probes/quant_linears.py --gemm-configs): per row count, the tile and
# launch `choose_config` starts from. (most rows, block_m, block_n, block_k, num_warps, num_stages); None: any.
TILES = ((16, 16, 64, 128, 4, 4),
         (32, 32, 64, 128, 4, 4),
         (64, 64, 64, 128, 4, 3),
         (None, 128, 128, 64, 8, 3))
MIN_BLOCK = 16          # the smallest side of a `tl.dot` tile


class QuantGemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _quant_gemm_kernel(X, Q, Scale, Bias, Out, M, N, K, stride_xm, stride_om, scale_cols,
                       HAS_BIAS: tl.constexpr, BLOCKWISE: tl.constexpr, TILE_SCALES: tl.constexpr,
                       QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    """A program's `[BLOCK_M, BLOCK_N]` tile of the output: x's rows m by q's rows n (the output's columns)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm             # [BLOCK_M, 1]
    q_cols = Q + n.to(tl.int64)[None, :] * K                      # [1, BLOCK_N]; int64: N * K can pass 2**31
    if BLOCKWISE:
        scale_rows = Scale + (n // QBLOCK) * scale_cols          # each output column's block row of scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + cols < K
        x = tl.load(x_rows + (k + cols)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(q_cols + (k + cols)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)   # [BLOCK_K, BLOCK_N]
        if TILE_SCALES:         # dequantize's float32 product, element by element, then x's dtype
            s = tl.load(scale_rows[None, :] + ((k + cols) // QBLOCK)[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc = tl.dot(x, (w.to(tl.float32) * s).to(x.dtype), acc, input_precision=PRECISION)
        elif BLOCKWISE:         # the step lies in one block column: one scale per output column
            s = tl.load(scale_rows + k // QBLOCK, mask=n_ok, other=0.0)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if not BLOCKWISE:           # per channel: the scale factors out of the sum
        acc = acc * tl.load(Scale + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + m.to(tl.int64)[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def choose_config(m: int, n: int, k: int, block_size: int | None) -> QuantGemmConfig:
    """Block sizes and launch for x `[m, k]` and q `[n, k]`: the first row of TILES whose row count holds m, its
    BLOCK_N and BLOCK_K cut to the next power of two of n and k (at least MIN_BLOCK); with block scales, BLOCK_K cut
    to the largest power of two dividing the block size, when that is MIN_BLOCK or more (else the scales multiply
    the weight tile, see the module's docstring). Depends only on the shapes (no autotuning), so a CUDA graph
    captured once keeps it and a run is reproducible."""
    _, block_m, block_n, block_k, num_warps, num_stages = next(t for t in TILES if t[0] is None or m <= t[0])
    block_n = min(block_n, max(MIN_BLOCK, triton.next_power_of_2(n)))
    block_k = min(block_k, max(MIN_BLOCK, triton.next_power_of_2(k)))
    if block_size is not None and block_size & -block_size >= MIN_BLOCK:
        block_k = min(block_k, block_size & -block_size)
    return QuantGemmConfig(block_m, block_n, block_k, num_warps, num_stages)


def quant_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
               bias: torch.Tensor | None = None, *, config: QuantGemmConfig | None = None) -> torch.Tensor:
    """`x.float() @ dequantize(q, scale, block_size).T (+ bias)`, cast to x.dtype, on the matrix units.

    x `[..., K]` float32, bfloat16 or float16; q `[N, K]` int8 or float8_e4m3fn, contiguous; scale float32,
    contiguous, `[N]` (block_size None: per output channel) or `[ceil(N/B), ceil(K/B)]` (block_size B: per B x B
    block, edge blocks partial), as `minirt.quant.formats.quantize` returns them; bias `[N]` in x's dtype or None.
    Returns `[..., N]` in x.dtype, accumulated in float32 (the arguments and result of `quant_gemv`). Meant for more
    rows than the GEMV's MAX_ROWS; it takes any number (BLOCK_M rows per program, padded by masks). config: block
    sizes and launch (None: `choose_config`); its block sizes must be powers of two of at least MIN_BLOCK.
    No host syncs: safe inside a CUDA graph capture. Raises ValueError naming the argument for shapes, strides,
    dtypes, devices or a config that do not fit."""
    n, k = check_quant_args(x, q, scale, block_size, bias)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    cfg = config or choose_config(m, n, k, block_size)
    if any(b < MIN_BLOCK or b & (b - 1) for b in cfg[:3]):
        raise ValueError(f"config: block_m, block_n, block_k must be powers of two >= {MIN_BLOCK}, got {cfg}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _quant_gemm_kernel[grid](
        x2, q, scale, bias if bias is not None else out, out, m, n, k, x2.stride(0), out.stride(0),
        1 if block_size is None else scale.shape[1],
        HAS_BIAS=bias is not None, BLOCKWISE=block_size is not None,
        TILE_SCALES=block_size is not None and block_size % cfg.block_k != 0, QBLOCK=block_size or 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,     # None: the dtype's own
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*lead, n)
