"""Matrix-vector products with quantized weights for few-row decode steps: `x @ dequantize(q, scale).T`, in Triton.

At batch 1 a decode step streams every weight once (`minirt.kernels.gemv_triton`); with the weights stored in one
byte (int8 or FP8 e4m3, `minirt.quant.formats`) the step reads half the bytes of bf16, but only if the kernel reads
the bytes themselves: dequantizing the whole weight first (the reference `QuantizedLinear.forward`) writes and
reads a bf16 copy, three times the bytes. Here each program loads a `[BLOCK_N, BLOCK_K]` tile of `q` (one byte per
element, contiguous along K), converts it to float32 in registers, multiplies it by its scales and by the matching
chunk of every row of x, and accumulates in float32:

* per output channel (`scale [N]`): the scale factors out of the sum, `y[m, n] = scale[n] * sum_k x[m, k] q[n, k]`,
  and multiplies once at the end;
* per B x B block (`scale [ceil(N/B), ceil(K/B)]`, DeepSeek-V3's and Qwen3-FP8's layout): a step's columns come
  in stretches whose length divides B, so each stretch lies in one block column and takes one scale per row,
  `q * scale` exactly as `dequantize` rounds it in float32. Partial edge blocks need nothing more than the masks.

One row (M = 1) keeps a float32 tile of products per lane and sums along K once at the end, as `linear_gemv` does;
a few rows (M <= 8 or so) sum each chunk's `[BLOCK_M, BLOCK_N, BLOCK_K]` products along K as they go, so the weight
tile is loaded once for all rows. No `tl.dot`: with this few rows there is nothing for the matrix units to reuse.
As `linear_gemv`, it can take SwiGLU's SiLU-and-multiply into its epilogue (a merged gate/up projection) and launch
with programmatic dependent launch.
This is the weight-only W8A16 GEMV of TensorRT-LLM's weight-only batched GEMV plugins and of vLLM's FP8 Marlin
kernel for decode, in the plain form of `linear_gemv`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minirt.kernels import num_sms

ROWS, COLS = 8, 1024    # a program's tile per loop step when there are enough rows: 8 KB of 1-byte weights
TILE_ELEMENTS = 8192    # at most this many products per program and step (BLOCK_M * BLOCK_N * BLOCK_K)
PROGRAMS_PER_SM = 2     # as linear_gemv: fewer leave multiprocessors idle or too few bytes in flight
NUM_WARPS = 4
MAX_ROWS = 8            # the most rows of x a weight tile is loaded for (more rows take more programs)


class QuantGemvConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = NUM_WARPS


@triton.jit
def _quant_gemv_kernel(X, Q, Scale, Bias, Out, M, N, K, stride_xm, stride_om, scale_cols,
                       HAS_BIAS: tl.constexpr, BLOCKWISE: tl.constexpr, QBLOCK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr,
                       SILU_AND_MUL: tl.constexpr, PDL: tl.constexpr):
    """A program's BLOCK_N output columns for BLOCK_M rows of x (with SILU_AND_MUL, columns of silu(gate) * up, the
    gate rows of q first, then its up rows, N apart)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()             # the next kernel may start (and load its weights)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    y = _quant_sums(X, Q, Scale, rows, row_ok, m, m_ok, M, K, stride_xm, scale_cols, BLOCKWISE, QBLOCK, BLOCK_M,
                    BLOCK_N, NB, SUB, PDL)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_AND_MUL:
        up = _quant_sums(X, Q, Scale, rows + N, row_ok, m, m_ok, M, K, stride_xm, scale_cols, BLOCKWISE, QBLOCK,
                         BLOCK_M, BLOCK_N, NB, SUB, PDL)
        if HAS_BIAS:
            up += tl.load(Bias + N + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        # As linear_gemv's epilogue: gate and up rounded to the output dtype, then silu(gate) * up in float32.
        gate = y.to(Out.dtype.element_ty).to(tl.float32)
        up = up.to(Out.dtype.element_ty).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
    tl.store(Out + m[:, None] * stride_om + rows[None, :], y.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _quant_sums(X, Q, Scale, rows, row_ok, m, m_ok, M, K, stride_xm, scale_cols, BLOCKWISE: tl.constexpr,
                QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                SUB: tl.constexpr, PDL: tl.constexpr):
    """The float32 products `[BLOCK_M, BLOCK_N]` of x's rows m with q's rows `rows`, scales applied. Each step of K
    covers NB * SUB columns, held as NB stretches of SUB columns that share a scale (block scales: SUB divides
    QBLOCK, so a stretch lies in one block column; per channel: NB = 1, the scale is applied after the loop)."""
    q_rows = Q + rows.to(tl.int64)[:, None, None] * K       # int64: N * K can pass 2**31
    stretch = tl.arange(0, NB)
    cols = stretch[:, None] * SUB + tl.arange(0, SUB)[None, :]   # [NB, SUB]: the step's columns, contiguous
    if BLOCKWISE:
        scale_rows = Scale + (rows // QBLOCK) * scale_cols      # each row's block row of scales
    acc_lanes = tl.zeros([BLOCK_N, NB, SUB], dtype=tl.float32)   # BLOCK_M == 1: per-lane sums (else unused)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, NB * SUB):
        k_ok = k + cols < K
        # The weights first: all loads of the step are issued before the arithmetic waits on one of them, and
        # with PDL they stream in while the kernel before finishes (no kernel writes them).
        w = tl.load(q_rows + (k + cols)[None, :, :], mask=row_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        if BLOCKWISE:
            s = tl.load(scale_rows[:, None] + (k + stretch * SUB)[None, :] // QBLOCK,
                        mask=row_ok[:, None] & (k + stretch * SUB < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()                      # x is the kernel before's output
        if BLOCK_M == 1:
            x = tl.load(X + tl.program_id(1) * stride_xm + k + cols, mask=k_ok, other=0.0)
        else:
            x = tl.load(X + m[:, None, None] * stride_xm + (k + cols)[None, :, :],
                        mask=m_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        w = w.to(tl.float32)
        if BLOCKWISE:
            w = w * s[:, :, None]                       # dequantize's float32 product, element by element
        if BLOCK_M == 1:
            acc_lanes += w * x.to(tl.float32)[None, :, :]
        else:
            prod = x.to(tl.float32)[:, None, :, :] * w[None, :, :, :]      # [BLOCK_M, BLOCK_N, NB, SUB]
            acc += tl.sum(tl.sum(prod, axis=3), axis=2)
    if PDL:
        tl.extra.cuda.gdc_wait()      # every program waits (a no-op after the loop's): completion stays in order
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(acc_lanes, axis=2), axis=1)[None, :]
    if not BLOCKWISE:   # per channel: the scale factors out of the sum
        acc = acc * tl.load(Scale + rows, mask=row_ok, other=0.0)[None, :]
    return acc


def choose_config(m: int, n: int, k: int, block_size: int | None, sm_count: int) -> QuantGemvConfig:
    """Block sizes for x `[m, k]` and q `[n, k]` (powers of two): BLOCK_M the next power of two of m (up to
    MAX_ROWS; more rows take more programs); ROWS rows per program when that leaves PROGRAMS_PER_SM programs per SM,
    else fewer (down to one); then as much of K per step as keeps BLOCK_M * BLOCK_N * BLOCK_K within TILE_ELEMENTS
    (up to COLS per row of 8). With block scales, the stretch of columns sharing a scale (SUB) is the largest power
    of two that divides the block size, up to BLOCK_K. Depends only on the shapes, so a CUDA graph captured once
    keeps it."""
    block_m = min(triton.next_power_of_2(max(m, 1)), MAX_ROWS)
    target = PROGRAMS_PER_SM * sm_count
    block_n = ROWS
    while block_n > 1 and triton.cdiv(n, block_n) < target:
        block_n //= 2
    block_k = min(max(16, triton.next_power_of_2(k)), TILE_ELEMENTS // (block_m * block_n), COLS * ROWS // block_n)
    block_k = max(block_k, 16)
    return QuantGemvConfig(block_m, block_n, block_k)


def _stretch(block_k: int, block_size: int | None) -> int:
    """SUB: the columns of a step that share one scale (`_quant_gemv_kernel`)."""
    return block_k if block_size is None else min(block_k, block_size & -block_size)


def check_quant_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None,
                     bias: torch.Tensor | None) -> tuple[int, int]:
    """The arguments of `quant_gemv` and `quant_gemm` (`minirt.kernels.quant_gemm_triton`), checked before any
    kernel runs: returns q's `(N, K)`. Raises ValueError naming the argument whose shape, stride, dtype or device
    does not fit (see `quant_gemv`)."""
    if x.dim() == 0:
        raise ValueError("x: must have a last dim of features, got a scalar")
    if q.dim() != 2 or q.shape[1] != x.shape[-1]:
        raise ValueError(f"q: must be [N, {x.shape[-1]}] to match x, got shape {tuple(q.shape)}")
    if q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"q: must be int8 or float8_e4m3fn, got {q.dtype}")
    if not q.is_contiguous():
        raise ValueError(f"q: must be contiguous, got strides {tuple(q.stride())}")
    n, k = q.shape
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size: must be an integer >= 1 or None, got {block_size!r}")
    want = (n,) if block_size is None else (triton.cdiv(n, block_size), triton.cdiv(k, block_size))
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale: must be a contiguous float32 {want} for a {(n, k)} weight with "
                         f"block_size={block_size}, got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous() or bias.dtype != x.dtype):
        raise ValueError(f"bias: must be a contiguous [{n}] in {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("q", q), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: must be on {x.device} like x, got {t.device}")
    return n, k


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` as the `[M, K]` rows the kernels read, contiguous along K (a copy only where it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quant_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
               bias: torch.Tensor | None = None, *, silu_and_mul: bool = False, pdl: bool = False,
               config: QuantGemvConfig | None = None) -> torch.Tensor:
    """`x.float() @ dequantize(q, scale, block_size).T (+ bias)`, cast to x.dtype, for few rows of x.

    x `[..., K]` (float32, bfloat16 or float16), q `[N, K]` int8 or float8_e4m3fn, contiguous; scale float32,
    contiguous, `[N]` (block_size None: per output channel) or `[ceil(N/B), ceil(K/B)]` (block_size B: per B x B
    block, edge blocks partial), as `minirt.quant.formats.quantize` returns them; bias `[N]` in x's dtype or None.
    Returns `[..., N]` in x.dtype, accumulated in float32. Meant for the few rows of a decode step (up to MAX_ROWS;
    it takes any number, loading the weights once per MAX_ROWS rows).
    silu_and_mul: q is a merged gate/up projection `[2 * I, K]` (gate rows, then up rows; bias `[2 * I]`) and the
    result is `silu(gate) * up` `[..., I]`, in the epilogue, gate and up rounded to x.dtype first (as
    `linear_gemv(silu_and_mul=True)`). pdl: launch with programmatic dependent launch (Hopper and later): the
    weight loads start before the wait for the kernel before (`linear_gemv`'s pdl). config: block sizes (None:
    `choose_config`).
    No host syncs: safe inside a CUDA graph capture. Raises ValueError naming the argument for shapes, strides,
    dtypes or devices that do not fit."""
    n, k = check_quant_args(x, q, scale, block_size, bias)
    if silu_and_mul:
        if n % 2:
            raise ValueError(f"q: silu_and_mul needs gate and up rows, an even count, got {n}")
        n //= 2
    if pdl:
        from minirt.kernels import pdl_missing

        if missing := pdl_missing(x.device):
            raise ValueError(f"pdl: programmatic dependent launch needs {' and '.join(missing)}")
    lead = x.shape[:-1]
    x2 = rows_of(x)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    cfg = config or choose_config(m, n, k, block_size, num_sms(x.device))
    sub = _stretch(cfg.block_k, block_size)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _quant_gemv_kernel[grid](
        x2, q, scale, bias if bias is not None else out, out, m, n, k, x2.stride(0), out.stride(0),
        1 if block_size is None else scale.shape[1],
        HAS_BIAS=bias is not None, BLOCKWISE=block_size is not None, QBLOCK=block_size or 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NB=cfg.block_k // sub, SUB=sub, SILU_AND_MUL=silu_and_mul,
        PDL=pdl, num_warps=cfg.num_warps, **({"launch_pdl": True} if pdl else {}))
    return out.reshape(*lead, n)
