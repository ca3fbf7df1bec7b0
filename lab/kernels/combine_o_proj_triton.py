"""A one-token step's split-KV combine and its o_proj in one kernel: one kernel boundary fewer per layer. A probe,
not used by the engine: measured slower at batch 1 than the combine kernel and the o_proj GEMV, 1.125x TPOT with
64-row tiles, every run (`lab/probes/combine_o_proj_probe.py`; lab/pages/combine-o-proj.md has the figures).

At batch 1 split-KV attention (`minirt.kernels.paged_attention_triton`) leaves each query head's output as
NUM_SPLITS partial results; a combine kernel turns them into the head's output, and o_proj, a GEMV over all heads'
outputs, runs after it. A kernel boundary on a batch-1 step's path costs time even with programmatic dependent
launch (lab/pages/launch-floor.md measures it). o_proj is linear, so it can be split by head:
`out = sum_h W[:, h*D:(h+1)*D] @ o_h`. Here program (h, tile) loads its `[BLOCK_N, D]` slice of W before it waits
for attention, combines head h's splits (the combine kernel's sums, rounded to the model's dtype as that kernel
stores them), multiplies, and stores `BLOCK_N` float32 partial sums. The last of the heads' programs to finish a
row tile (an atomic count, the "last block" pattern of `_last_split_combines`) adds the heads' partial sums in head
order and stores the rows: the sum does not depend on which program finishes last, so a step's output is the same
on every run. Rounding differs from the two kernels only in the order of o_proj's float32 sums.
"""

from __future__ import annotations

from unittest import mock

import torch
import triton
import triton.language as tl

from minirt.kernels import paged_attention_triton as attention
from minirt.kernels.gemv_triton import _prefetch_l2, check_l2_prefetch

BLOCK_N = 64        # o_proj rows per program: 16 row tiles x 16 heads = 256 programs for Qwen3-0.6B's 1024 rows
NUM_WARPS = 4


@triton.jit
def _combine_o_proj_kernel(PartAcc, PartM, PartL, W, Bias, Out, Part, Counters, Prefetch, num_prefetch, N, K,
                           HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                           BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                           L2_PREFETCH: tl.constexpr):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    d = tl.arange(0, HEAD_DIM)
    # The weights first: no kernel writes them, so with PDL they load while attention runs.
    w = tl.load(W + rows.to(tl.int64)[:, None] * K + head * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if L2_PREFETCH:     # chunks of the next kernel's weights, asked of L2 by turns (`linear_gemv`'s l2_prefetch)
        for chunk in range(head * tl.num_programs(1) + tile, num_prefetch, tl.num_programs(0) * tl.num_programs(1)):
            _prefetch_l2(tl.load(Prefetch + 2 * chunk), tl.load(Prefetch + 2 * chunk + 1).to(tl.int32))
    if PDL:
        tl.extra.cuda.gdc_wait()                          # the partial results are attention's output
    # `_combine_splits_kernel`'s sums for head h of the one token
    row = head * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    m = tl.load(PartM + row + s)
    weight = tl.exp(m - tl.max(m, 0))
    acc = tl.load(PartAcc + (row + s)[:, None] * HEAD_DIM + d[None, :])
    o = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * tl.load(PartL + row + s), 0)
    o = o.to(Out.dtype.element_ty).to(tl.float32)         # the attention output as the combine would store it
    y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
    tl.store(Part + head * N + rows, y, mask=row_ok)
    # Memory order as in `_last_split_combines`: the barrier puts every thread's stores before the count, whose
    # release makes them visible to the program that acquires the final count; it reads through L2 (.cg).
    tl.debug_barrier()
    ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_HEADS - 1:
        tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h in range(NUM_HEADS):                        # in head order, whichever program finishes last
            total += tl.load(Part + h * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(Out + rows, total.to(Out.dtype.element_ty), mask=row_ok)


class _KeepPartials:
    """Stands in for `_combine_splits_kernel` during one `paged_attention_triton` call: launches nothing and keeps the
    partial results the combine would have read."""

    def __init__(self):
        self.parts = None

    def __getitem__(self, grid):
        return self._keep

    def _keep(self, out, part_acc, part_m, part_l, *args, **kwargs):
        self.parts = (part_acc, part_m, part_l)


def paged_attention_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, **options):
    """`minirt.kernels.paged_attention_triton.paged_attention_triton(q, k_cache, v_cache, meta, **options)` without its
    combine: with split-KV (and no split_counters), the splits' partial results `(acc [num_tokens, H, num_splits, D],
    m [num_tokens, H, num_splits], l [...])` (each split's running max and sum of its softmax, float32), for
    `combine_o_proj` to combine; without split-KV, the output as usual. The engine's attention launch runs unchanged
    (same tiles, same prefetch); only its combine launch is replaced, for the length of the call, by one that keeps
    its arguments. Safe inside a CUDA graph capture (the capture records the attention kernel alone)."""
    keep = _KeepPartials()
    with mock.patch.object(attention, "_combine_splits_kernel", keep):
        out = attention.paged_attention_triton(q, k_cache, v_cache, meta, **options)
    return out if keep.parts is None else keep.parts


def counters_for(n: int, device: torch.device, block_n: int = BLOCK_N) -> torch.Tensor:
    """The zeroed int32 buffer `combine_o_proj` counts finished heads in, one per row tile of an `[n, ...]` o_proj
    weight. Allocate it once, before any CUDA graph capture; the kernel keeps it zeroed between launches."""
    return torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=device)


def combine_o_proj(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, counters: torch.Tensor, dtype: torch.dtype, *, pdl: bool = False,
                   l2_prefetch: torch.Tensor | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """o_proj of one token's split-KV attention: `F.linear(combine(parts).to(dtype).flatten(), weight, bias)`.

    part_acc `[1, H, S, D]`, part_m and part_l `[1, H, S]`, float32: split-KV's partial results for one token
    (`paged_attention_partials`), S a power of two; weight `[N, H * D]` contiguous, bias `[N]` or
    None, both in `dtype`; counters: `counters_for(N, ...)` (zeroed; left zeroed) -> `[N]` in dtype. The head
    outputs are the combine kernel's, rounded to dtype; o_proj's float32 sums run per head, then over heads in
    head order. pdl and l2_prefetch as in `minirt.kernels.gemv_triton.linear_gemv` (the caller checks that they
    can run). Raises ValueError naming the argument whose shape, dtype, layout or device does not fit, or whose size
    (head_dim, splits, block_n) is not a power of two."""
    if part_acc.dim() != 4 or part_acc.shape[0] != 1 or part_acc.dtype != torch.float32 or not part_acc.is_contiguous():
        raise ValueError(f"part_acc: must be a contiguous float32 [1, heads, splits, head_dim], got "
                         f"{part_acc.dtype} {tuple(part_acc.shape)}")
    _, heads, splits, head_dim = part_acc.shape
    for name, t in (("part_m", part_m), ("part_l", part_l)):
        if tuple(t.shape) != (1, heads, splits) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: must be a contiguous float32 [1, {heads}, {splits}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if weight.dim() != 2 or weight.shape[1] != heads * head_dim or not weight.is_contiguous() or weight.dtype != dtype:
        raise ValueError(f"weight: must be a contiguous {dtype} [N, {heads * head_dim}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    for name, value in (("head_dim", head_dim), ("splits", splits), ("block_n", block_n)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: must be a power of two (a Triton block), got {value}")
    n = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != dtype or not bias.is_contiguous()):
        raise ValueError(f"bias: must be a contiguous {dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}, strides "
                         f"{tuple(bias.stride())}")
    if counters.dtype != torch.int32 or counters.numel() < triton.cdiv(n, block_n) or not counters.is_contiguous():
        raise ValueError(f"counters: must be a contiguous int32 tensor with at least {triton.cdiv(n, block_n)} "
                         f"elements (counters_for), got {counters.dtype} with {counters.numel()}")
    if l2_prefetch is not None:
        check_l2_prefetch(l2_prefetch, part_acc.device)
    for name, t in (("weight", weight), ("bias", bias), ("counters", counters), ("part_m", part_m),
                    ("part_l", part_l)):
        if t is not None and t.device != part_acc.device:
            raise ValueError(f"{name}: must be on {part_acc.device} like part_acc, got {t.device}")
    out = torch.empty(n, dtype=dtype, device=weight.device)
    part = torch.empty(heads, n, dtype=torch.float32, device=weight.device)
    launch = {"launch_pdl": True} if pdl else {}
    _combine_o_proj_kernel[(heads, triton.cdiv(n, block_n))](
        part_acc, part_m, part_l, weight, bias if bias is not None else out, out, part, counters,
        l2_prefetch if l2_prefetch is not None else counters, 0 if l2_prefetch is None else l2_prefetch.shape[0],
        n, heads * head_dim, HEAD_DIM=head_dim, NUM_SPLITS=splits, NUM_HEADS=heads, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, PDL=pdl, L2_PREFETCH=l2_prefetch is not None, num_warps=NUM_WARPS, **launch)
    return out
