"""Matrix-vector product for one-token decode steps: `F.linear` when x has one row (M = 1), in Triton.

At batch 1 a decode step is a chain of matrix-vector products: every weight is read once and used for
one multiply-add per element, so the step's time is the time to stream the weights from memory. cuBLAS's
GEMM kernels are tuned for larger M: at M = 1 they launch too few blocks, or blocks that keep too few
bytes in flight, and leave most of the bandwidth unused.

Here each program owns BLOCK_N output rows. It walks K in BLOCK_K chunks, loading a [BLOCK_N, BLOCK_K]
tile of W (contiguous along K, so the loads are wide and coalesced) and the matching chunk of x, and
keeps a float32 tile of products; one sum along K at the end gives its rows. No `tl.dot`: with one row
of x there is nothing for the matrix units to reuse. When even one row per program leaves the GPU short
of programs, split-K gives several programs one output row range each, each summing an interleaved share
of the K chunks into a float32 buffer, and a second small kernel adds the shares, the bias, and casts.

The idea is the usual one for weight streaming at small batch: TensorRT-LLM's weight-only batched GEMV
plugins and the GEMV kernels that `torch.compile` generates in gpt-fast. `choose_config` picks the block
sizes from the constants below.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minirt.kernels import num_sms

# Defaults read by `choose_config` (powers of two; swept by lab/probes/gemv.py, checked in the engine by
# lab/probes/kernel_choices.py): ROWS x COLS tiles for the wide matrices (q/k/v, gate/up, the LM head), one row per
# program for the 1024-row ones (o_proj, down_proj), so that more programs than SMs run.
ROWS, COLS = 8, 512     # a program's tile per loop step when there are enough rows: 8 KB of bf16
MAX_BLOCK_K = 2048      # one-row programs read up to this much of their row per step
PROGRAMS_PER_SM = 2     # fewer programs leave multiprocessors idle or too few bytes in flight to hide latency
MAX_SPLIT_K = 8
NUM_WARPS = 4
L2_PREFETCH_CHUNK = 16384   # bytes per bulk prefetch request (`l2_prefetch_table`)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = NUM_WARPS


@triton.jit
def _prefetch_l2(address, size):
    """Thread 0 of the program asks the SM's bulk-copy unit (TMA) to bring `size` bytes at `address` into the L2 cache
    (`cp.async.bulk.prefetch.L2`, Hopper and later): a hint that holds no registers and is not waited for."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 tid; .reg .pred p; mov.u32 tid, %tid.x; setp.eq.u32 p, tid, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(X, W, Scale, Bias, Out, Part, Res, NormW, Stream, Prefetch, num_prefetch, Key, N, K, stride_x,
                 eps, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 PDL: tl.constexpr, L2_PREFETCH: tl.constexpr, ARGMAX: tl.constexpr):
    split = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()             # the next kernel may start (and load its weights)
    if L2_PREFETCH:     # chunks of the weights the kernels after this one read, asked of L2 by turns
        for chunk in range(tl.program_id(0) * SPLIT_K + split, num_prefetch, tl.num_programs(0) * SPLIT_K):
            _prefetch_l2(tl.load(Prefetch + 2 * chunk), tl.load(Prefetch + 2 * chunk + 1).to(tl.int32))
    if ARGMAX:          # the rows' logits are never stored: only the best of them, into Key
        rows, row_ok, y, _ = _gemv_sums(tl.program_id(0), split, X, W, Scale, Res, NormW, Stream, N, K, stride_x, eps,
                                        SCALED, BLOCK_N, BLOCK_K, 1, False, NORM, HAS_RESIDUAL, PDL)
        if HAS_BIAS:
            y += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
        _argmax_into(Key, y.to(Out.dtype.element_ty).to(tl.float32), rows, row_ok)
    else:
        _gemv_rows(tl.program_id(0), split, X, W, Scale, Bias, Out, Part, Res, NormW, Stream, N, K, stride_x, eps,
                   SCALED, HAS_BIAS, BLOCK_N, BLOCK_K, SPLIT_K, SILU_AND_MUL, NORM, HAS_RESIDUAL, PDL)


@triton.jit
def _argmax_into(Key, logits, rows, row_ok):
    """Fold this program's best logit into `Key` (one int64, read as unsigned): the largest of `logits` `[BLOCK_N]`
    (float32 values of the output dtype) and its first row, packed so that a larger key means a larger logit and,
    among equal logits, a lower row, then taken with an atomic maximum. Once every program has run, Key holds the
    argmax over all rows with torch.argmax's ties (the first index) and its NaN order (a NaN, of either sign, above
    every number: the first NaN row wins). A float's bits, as an unsigned integer, sort like the float once negatives
    have all their bits flipped and the others their sign bit set."""
    is_nan = (logits != logits) & row_ok
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    logits = tl.where(row_ok & ~is_nan, logits, float("-inf"))
    best = tl.max(logits, axis=0)
    first = tl.min(tl.where(tl.where(any_nan, is_nan, logits == best), rows, 2147483647), axis=0)
    bits = (best + 0.0).to(tl.int32, bitcast=True)        # + 0.0: -0.0 becomes +0.0, so equal logits pack equally
    bits = tl.where(any_nan, 0x7FC00000, bits)            # every NaN as the one positive quiet NaN: above +inf
    ordered = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.uint32, bitcast=True)
    key = (ordered.to(tl.uint64) << 32) | (4294967295 - first.to(tl.int64)).to(tl.uint64)
    tl.atomic_max(Key.to(tl.pointer_type(tl.uint64)), key, sem="relaxed")


@triton.jit
def _argmax_finish_kernel(Key, Token, PDL: tl.constexpr):
    """Token = the row packed in Key (`_argmax_into`); Key back to 0 for the next product."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()                          # every program of the product has folded its key in
    key = tl.load(Key)
    tl.store(Token, 4294967295 - (key & 4294967295))
    tl.store(Key, 0)


@triton.jit
def _gemv_rows(tile, split, X, W, Scale, Bias, Out, Part, Res, NormW, Stream, N, K, stride_x, eps,
               SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT_K: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               PDL: tl.constexpr):
    """Output rows `tile * BLOCK_N ...` (split `split` of SPLIT_K): `_gemv_kernel`'s work for one program."""
    rows, row_ok, y, up = _gemv_sums(tile, split, X, W, Scale, Res, NormW, Stream, N, K, stride_x, eps, SCALED,
                                     BLOCK_N, BLOCK_K, SPLIT_K, SILU_AND_MUL, NORM, HAS_RESIDUAL, PDL)
    if SPLIT_K == 1:
        _store_rows(y, up, rows, row_ok, Bias, Out, N, HAS_BIAS, SILU_AND_MUL)
    else:
        tl.store(Part + split * N + rows, y, mask=row_ok)


@triton.jit
def _gemv_sums(tile, split, X, W, Scale, Res, NormW, Stream, N, K, stride_x, eps, SCALED: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SILU_AND_MUL: tl.constexpr,
               NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """`_gemv_rows`' sums: (rows, rows < N, the rows' float32 dot products with the norm's scale applied, the up rows'
    (SILU_AND_MUL; else the first again)); split `split`'s share of them when SPLIT_K > 1. SCALED: W holds one-byte
    quantized weights, converted to float32 as they are loaded, and each row's sum is multiplied by its scale
    (Scale `[N]`, or `[2 * N]` with SILU_AND_MUL) at the end, where a per-channel scale factors out of the sum."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * K          # int64: N * K can pass 2**31 (a large vocabulary)
    up_rows = W + (rows + N).to(tl.int64)[:, None] * K    # SILU_AND_MUL: the up row of each gate row, N rows on
    cols = tl.arange(0, BLOCK_K)
    # Elementwise products accumulate per lane; the one cross-thread sum comes after the loop, so no
    # step waits on a reduction before issuing its next loads.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)     # SILU_AND_MUL only (unused, removed otherwise)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)              # NORM only: the norm's sum of squares, per lane
    for k in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):    # split-K: this program's share of the chunks
        k_ok = k + cols < K
        # All loads of the step are issued before any arithmetic waits on one of them; the weights first,
        # since no kernel writes them: with PDL they stream in while the kernel before finishes.
        w = tl.load(w_rows + (k + cols)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SILU_AND_MUL:
            u = tl.load(up_rows + (k + cols)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            g = tl.load(NormW + k + cols, mask=k_ok, other=0.0)      # a weight too: no kernel writes it
        if PDL:
            tl.extra.cuda.gdc_wait()                      # x and the residual are the kernel before's output
        x = tl.load(X + (k + cols) * stride_x, mask=k_ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(Res + k + cols, mask=k_ok, other=0.0)
        if HAS_RESIDUAL:
            # The residual addition, rounded to the stream's dtype as in `add_rms_norm`; one program keeps it.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            if tile == 0:
                tl.store(Stream + k + cols, x, mask=k_ok)
        xf = x.to(tl.float32)
        if NORM:
            # rms_norm(x) * g = rstd * (g * x): the scalar rstd factors out of the dot products, so it is
            # applied after the loop, from the sum of squares gathered on the way.
            sum_sq += xf * xf
            xf = xf * g.to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if SILU_AND_MUL:
            acc_up += u.to(tl.float32) * xf[None, :]
    if PDL:
        tl.extra.cuda.gdc_wait()      # every program waits (a no-op after the loop's): completion stays in order
    y = tl.sum(acc, axis=1)
    if SCALED:
        y = y * tl.load(Scale + rows, mask=row_ok, other=0.0)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        y = y * rstd
    up = y
    if SILU_AND_MUL:
        up = tl.sum(acc_up, axis=1)
        if SCALED:
            up = up * tl.load(Scale + N + rows, mask=row_ok, other=0.0)
        if NORM:
            up = up * rstd
    return rows, row_ok, y, up


@triton.jit
def _store_rows(y, up, rows, row_ok, Bias, Out, N, HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """The epilogue of a program's rows: y `[BLOCK_N]` float32 dot products (the norm's scale applied), up the up
    rows' (SILU_AND_MUL; ignored otherwise); adds the bias, applies SiLU-and-multiply, stores in Out's dtype."""
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
    if SILU_AND_MUL:
        # As the compiled path (`fused_ops`): gate and up rounded to the output dtype, then silu(gate) * up
        # in float32, rounded once (eager torch also rounds silu(gate) before the product).
        if HAS_BIAS:
            up += tl.load(Bias + N + rows, mask=row_ok, other=0.0).to(tl.float32)
        gate = y.to(Out.dtype.element_ty).to(tl.float32)
        up = up.to(Out.dtype.element_ty).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
    tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=row_ok)


@triton.jit
def _sum_splits_kernel(Part, Bias, Out, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    s = tl.arange(0, SPLIT_K)
    y = tl.sum(tl.load(Part + s[:, None] * N + rows[None, :], mask=ok[None, :], other=0.0), axis=0)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=ok)


def choose_config(n: int, k: int, sm_count: int, split_k: bool = True) -> GemvConfig:
    """Block sizes for W `[n, k]`: ROWS x COLS tiles if that still gives PROGRAMS_PER_SM programs per SM; else
    one row per program, up to MAX_BLOCK_K of it per loop step, and split-K while there are still too few
    programs (unless `split_k` is False). Depends only on the shapes, so a CUDA graph captured once keeps it."""
    target = PROGRAMS_PER_SM * sm_count
    if triton.cdiv(n, ROWS) >= target:
        return GemvConfig(ROWS, min(COLS, max(16, triton.next_power_of_2(k))))
    block_k = min(MAX_BLOCK_K, max(16, triton.next_power_of_2(k)))
    splits = 1
    while split_k and splits < MAX_SPLIT_K and n * splits < target and 2 * splits <= triton.cdiv(k, block_k):
        splits *= 2
    return GemvConfig(1, block_k, splits)


def l2_prefetch_table(tensors, chunk_bytes: int = L2_PREFETCH_CHUNK) -> torch.Tensor:
    """What `linear_gemv(l2_prefetch=...)` asks the L2 cache for: the bytes of `tensors` (contiguous CUDA tensors
    on one device, each 16-byte aligned and a multiple of 16 bytes long, as the bulk copy needs) cut into
    chunks of chunk_bytes (a multiple of 16; a tensor's last chunk may be shorter), as an int64 `[chunks, 2]`
    tensor of (address, bytes) on their device. Build it once, before any CUDA graph capture (it copies from the
    host). Raises ValueError naming tensors or chunk_bytes."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("tensors: give at least one tensor to prefetch")
    if chunk_bytes < 16 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes: must be a positive multiple of 16, got {chunk_bytes}")
    for t in tensors:
        if (t.device != tensors[0].device or t.device.type != "cuda" or not t.is_contiguous()
                or t.data_ptr() % 16 or t.nbytes % 16):
            raise ValueError(f"tensors: each must be a contiguous CUDA tensor on one device, 16-byte aligned and a "
                             f"multiple of 16 bytes long, got {tuple(t.shape)} {t.dtype} on {t.device} "
                             f"({t.nbytes} bytes at address {t.data_ptr():#x})")
    rows = prefetch_chunks([(t.data_ptr(), t.nbytes) for t in tensors], chunk_bytes)
    return torch.tensor(rows, dtype=torch.int64).to(tensors[0].device)


def prefetch_chunks(spans: list[tuple[int, int]], chunk_bytes: int) -> list[tuple[int, int]]:
    """(address, bytes) spans -> the (address, bytes) chunks of `l2_prefetch_table`: each span cut at every
    chunk_bytes from its start, the last piece shorter when the span is not a multiple of chunk_bytes."""
    return [(address + start, min(chunk_bytes, nbytes - start))
            for address, nbytes in spans for start in range(0, nbytes, chunk_bytes)]


def check_l2_prefetch(table: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError naming l2_prefetch unless `table` is what `l2_prefetch_table` builds: a contiguous int64
    `[chunks, 2]` tensor on `device`."""
    if (table.dtype != torch.int64 or table.device != device or table.dim() != 2 or table.shape[1] != 2
            or not table.is_contiguous()):
        raise ValueError(f"l2_prefetch: must be a contiguous int64 [chunks, 2] table on {device} "
                         f"(l2_prefetch_table), got {table.dtype} {tuple(table.shape)} on {table.device}")


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None, silu_and_mul: bool = False, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, residual: torch.Tensor | None = None, pdl: bool = False,
                l2_prefetch: torch.Tensor | None = None, argmax_key: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None):
    """`torch.nn.functional.linear(x, weight, bias)` for one row: x `[..., K]` with x.numel() == K, weight
    `[N, K]` contiguous, bias `[N]` or None -> `[..., N]` in x.dtype, accumulated in float32.

    silu_and_mul: weight is a merged gate/up projection `[2 * I, K]` (gate rows, then up rows; bias `[2 * I]`)
    and the result is `silu(gate) * up` `[..., I]`, computed in the kernel's epilogue: one kernel instead of a
    GEMV and an elementwise one, and the `[2 * I]` intermediate never goes to memory (epilogue fusion; the
    SwiGLU GEMM of TensorRT-LLM's `gemm_swiglu` plugin). Its programs never split K.
    norm_weight `[K]`: the RMSNorm before the projection runs in the kernel's prologue (prologue fusion): the
    product is taken with `rms_norm(s, norm_weight, eps)`, where the stream `s = residual + x` (rounded to
    x.dtype, as `minirt.model.layers.add_rms_norm` does) or `x` when residual is None, and the call returns
    `(out, s)`. Every program reads all of x anyway; it also sums the squares and scales its dot products by
    `rsqrt(mean(s**2) + eps)` at the end (`rms_norm(s) * g = rstd * (g * s)`), so the norm costs no kernel of its
    own. Rounding differs from the unfused norm only in that the normalized row is never rounded to x.dtype.
    Its programs never split K. residual `[..., K]` (x's shape, contiguous) needs norm_weight.
    pdl: launch with programmatic dependent launch (Hopper and later; CUDA's PDL, as in CUTLASS's example 63,
    "GEMM with weight prefetch"): the kernel may start while the kernel before it finishes; it issues its first
    weight loads, then waits (`griddepcontrol.wait`) before reading x, so loading weights overlaps the previous
    kernel's tail. Raises ValueError if `minirt.kernels.pdl_missing(x.device)` lists anything.
    l2_prefetch: None, or a table from `l2_prefetch_table`: before its own loads, the kernel's programs ask the L2
    cache for its chunks, by turns (Hopper's bulk prefetch, which needs what PDL needs), so that the weights a
    later kernel reads stream in from memory while this one leaves the memory bus partly idle; that kernel then
    finds them in L2 (the weight streaming of persistent "megakernels", one kernel early). A hint: the result
    does not change.
    argmax_key: None, or an int64 `[1]` tensor on x's device holding 0: the call returns the argmax of the row's
    logits, int64 `[...]` (x's leading dims; ties to the first index and any NaN above every number, as
    `torch.argmax`), in place of the logits, which never go to memory: each program folds its best logit and row
    into argmax_key with an atomic maximum, and a one-program kernel after the product reads the winner and sets
    argmax_key back to 0 (greedy sampling in the LM head's epilogue; the logits compared are those the call would
    return, rounded to x.dtype). Not with silu_and_mul, or config's split_k > 1.
    weight_scale: None, or float32 `[N]` (contiguous; `[2 * I]` with silu_and_mul): weight holds chapter 10's
    one-byte weights (int8 or float8_e4m3fn, `minirt.quant.formats.quantize` with one scale per output channel) and
    the product is taken with `weight.float() * weight_scale[:, None]` (`dequantize`'s values): each weight is
    converted to float32 as it is loaded and each row's sum multiplied by its scale at the end, so a step reads one
    byte per weight and every option above works unchanged (the W8A16 GEMV of TensorRT-LLM's weight-only plugins).
    config: block sizes (None: `choose_config`). No host syncs: safe inside a CUDA graph capture.
    Raises ValueError naming the argument for shapes, strides, dtypes or devices that do not fit."""
    if x.dim() == 0 or math.prod(x.shape[:-1]) != 1:
        raise ValueError(f"x: must have exactly one row (leading dims multiplying to 1), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: must be [N, {x.shape[-1]}] to match x, got shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"weight: must be contiguous, got strides {tuple(weight.stride())}")
    n, k = weight.shape
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: must be a contiguous [{n}], got shape {tuple(bias.shape)}, strides {tuple(bias.stride())}")
    if norm_weight is not None and (tuple(norm_weight.shape) != (k,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight: must be a contiguous [{k}], got shape {tuple(norm_weight.shape)}")
    if residual is not None:
        if norm_weight is None:
            raise ValueError("residual: is added in the norm's prologue, so it needs norm_weight")
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"residual: must be contiguous with x's shape {tuple(x.shape)}, got shape "
                             f"{tuple(residual.shape)}, strides {tuple(residual.stride())}")
    if weight_scale is not None:
        if weight.dtype not in (torch.int8, torch.float8_e4m3fn) or weight.device != x.device:
            raise ValueError(f"weight: with weight_scale, must be int8 or float8_e4m3fn on {x.device}, got "
                             f"{weight.dtype} on {weight.device}")
        if (tuple(weight_scale.shape) != (n,) or weight_scale.dtype != torch.float32
                or not weight_scale.is_contiguous() or weight_scale.device != x.device):
            raise ValueError(f"weight_scale: must be a contiguous float32 [{n}] (one scale per output channel) on "
                             f"{x.device}, got {weight_scale.dtype} {tuple(weight_scale.shape)} on "
                             f"{weight_scale.device}")
    for name, t in (("weight", None if weight_scale is not None else weight), ("bias", bias),
                    ("norm_weight", norm_weight), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name}: must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
    if silu_and_mul:
        if n % 2:
            raise ValueError(f"weight: silu_and_mul needs gate and up rows, an even count, got {n}")
        n //= 2
    if argmax_key is not None:
        if (argmax_key.dtype != torch.int64 or tuple(argmax_key.shape) != (1,) or argmax_key.device != x.device):
            raise ValueError(f"argmax_key: must be an int64 [1] tensor on {x.device}, got {argmax_key.dtype} "
                             f"{tuple(argmax_key.shape)} on {argmax_key.device}")
        if silu_and_mul:
            raise ValueError("argmax_key: the argmax of a SiLU-and-multiply product is not a sampler's; give one or "
                             "the other")
    whole_k = silu_and_mul or norm_weight is not None or argmax_key is not None
    if whole_k and config is not None and config.split_k > 1:
        raise ValueError(f"config: silu_and_mul, norm_weight and argmax_key never split K, got "
                         f"split_k={config.split_k}")
    if pdl or l2_prefetch is not None:
        from minirt.kernels import pdl_missing

        if missing := pdl_missing(x.device):
            name = "pdl: programmatic dependent launch" if pdl else "l2_prefetch: the bulk prefetch into L2"
            raise ValueError(f"{name} needs {' and '.join(missing)}")
    if l2_prefetch is not None:
        check_l2_prefetch(l2_prefetch, x.device)

    if argmax_key is not None and n == 0:
        raise ValueError("weight: the argmax needs at least one row, got none")
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device) if argmax_key is None else \
        torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    stream = x if residual is None else torch.empty_like(x)
    if n == 0:
        if residual is not None:
            torch.add(residual, x, out=stream)
        return out if norm_weight is None else (out, stream)
    cfg = config or choose_config(n, k, num_sms(x.device), split_k=not whole_k)
    xv = x.reshape(k)                                      # a view: one row has a single stride along K
    has_bias = bias is not None
    part = torch.empty(cfg.split_k, n, dtype=torch.float32, device=x.device) if cfg.split_k > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    launch = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[grid](
        xv, weight, weight_scale if weight_scale is not None else out, bias if has_bias else out,
        out if argmax_key is None else x, part,                                     # argmax: Out only gives
        residual if residual is not None else out, norm_weight if norm_weight is not None else out, stream,  # a dtype
        l2_prefetch if l2_prefetch is not None else out, 0 if l2_prefetch is None else l2_prefetch.shape[0],
        argmax_key if argmax_key is not None else out, n, k, xv.stride(0), eps, SCALED=weight_scale is not None,
        HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, PDL=pdl,
        L2_PREFETCH=l2_prefetch is not None, ARGMAX=argmax_key is not None, num_warps=cfg.num_warps, **launch)
    if argmax_key is not None:
        _argmax_finish_kernel[(1,)](argmax_key, out, PDL=pdl, num_warps=1, **launch)
    if cfg.split_k > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](part, bias if has_bias else out, out, n,
                                                    HAS_BIAS=has_bias, SPLIT_K=cfg.split_k, BLOCK=1024, PDL=pdl,
                                                    **launch)
    return out if norm_weight is None else (out, stream)
