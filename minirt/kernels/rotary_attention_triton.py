"""Decode attention that takes q, k and v straight from the q/k/v projection: Qwen3's q/k norm, the rotation and the
K/V cache write in the attention kernel's prologue, so that a decode step runs one kernel per layer between the
projections where `norm_rotate_and_store_triton` and `paged_attention_triton` run two.

At batch 1 every kernel boundary of a layer lies on the step's critical path: the next kernel waits for the last
program of the one before, then loads what it wrote. The rotary kernel's whole work (a few hundred values a head)
is smaller than that wait (`benchmarks/batch1_ablation.py`). Here each program of `paged_attention_triton`'s
decode launch (one sequence, one KV head, one split of its keys) normalizes and rotates its own query heads, and
the new key of its KV head, after the PDL wait, from cos, sin and the norm weights loaded before it; the program
whose split holds the new position writes the rotated key and the value into their cache slot, and every split
uses the new key and value from its registers rather than from the cache. The arithmetic is the rotary kernel's
(`minirt.kernels.rotary_triton`, rounded as eager torch rounds) followed by the attention kernel's
(`minirt.kernels.paged_attention_triton`, whose helpers and split-KV combine this one shares). vLLM's
`MLA` decode path and FlashInfer's `BatchDecodeWithPagedKVCache` with `pos_encoding_mode="ROPE_LLAMA"` rotate
inside the attention kernel the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.attention import PagedAttentionMetadata
from minirt.kernels.paged_attention_triton import (SPLIT_TILE, DECODE_TILE, _attend_tile, _combine_splits_kernel,
                                                   _kv_offsets, _last_split_combines, check_store_kv_args,
                                                   choose_num_splits)
from minirt.kernels.rotary_triton import _check, _round


@triton.jit
def _norm_rotate_rows(src, rows_ok, Wt, c, s, d, partner, rotated, eps, NORM: tl.constexpr,
                      HEAD_DIM: tl.constexpr, ROT: tl.constexpr, DT: tl.constexpr):
    """Rows `[R, HEAD_DIM]` at `src` (pointers to each row's first channel, `[R, 1]`; rows outside rows_ok read 0):
    the head's RMSNorm with weight Wt (when NORM), then the rotation, each op rounded to DT as the rotary kernel's
    partial-rotary branch rounds. c, s `[1, HEAD_DIM]` (1 and 0 past the rotary dim); `partner` each rotated
    channel's `rotate_half` source."""
    x = tl.load(src + d, mask=rows_ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rows_ok & rotated, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = _round(tl.load(Wt + d).to(tl.float32) * _round(x * rstd, DT), DT)
        xp = _round(tl.load(Wt + partner, mask=rotated, other=0.0).to(tl.float32) * _round(xp * rstd, DT), DT)
    rotated_half = tl.where(d < ROT // 2, -xp, xp)                    # rotate_half(x): exact
    return tl.where(rotated, _round(_round(x * c, DT) + _round(rotated_half * s, DT), DT), x).to(DT)


@triton.jit(do_not_specialize=["stride_bt"])
def _rotary_decode_attention_kernel(
    Q, K, V, KCache, VCache, Out, PartAcc, PartM, PartL, Counters, Cos, Sin, QW, KW, eps,
    block_tables, context_lens, slot_mapping, scale,
    stride_qt, stride_kt, stride_vt, stride_ct, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, NORM: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LAST_COMBINES: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)                 # a decode batch: sequence `seq` has one new token, token `seq`
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait (with PREFETCH) only what no kernel of this forward pass writes: the step's metadata, cos and
    # sin (computed before the forward's first PDL launch), the norm weights, and earlier steps' keys and values.
    ctx = tl.load(context_lens + seq)
    pos = ctx - 1                                                   # the new token's position
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP                                              # one token: GROUP query rows of BLOCK_M
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)[None, :]
    rotated = d < ROT
    partner = tl.where(d < ROT // 2, d + ROT // 2, d - ROT // 2)     # rotate_half's source channel
    c = tl.load(Cos + seq * stride_ct + d, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(Sin + seq * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    dt = KCache.dtype.element_ty

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    share = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N     # split-KV: one contiguous share of the keys
    lo = split * share
    hi = tl.minimum(ctx, lo + share)
    table = block_tables + seq * stride_bt
    dk = tl.arange(0, HEAD_DIM)
    start = lo
    if PREFETCH:            # the first BLOCK_N keys of earlier steps, before the wait
        n = lo + tl.arange(0, BLOCK_N)
        offs = _kv_offsets(table, n, n < hi, kv_head, dk, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        old = (n < hi) & (n < pos)
        k_old = tl.load(KCache + offs, mask=old[:, None], other=0.0)
        v_old = tl.load(VCache + offs, mask=old[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()                    # q, k and v are the projection's output
    # This step's query heads and key, normalized and rotated; the value as it is.
    q = _norm_rotate_rows(Q + seq * stride_qt + head[:, None] * HEAD_DIM, row_ok[:, None], QW, c, s, d, partner,
                          rotated, eps, NORM, HEAD_DIM, ROT, dt)
    k_new = _norm_rotate_rows(K + seq * stride_kt + kv_head * HEAD_DIM + tl.zeros([1, 1], tl.int32), d >= 0, KW, c,
                              s, d, partner, rotated, eps, NORM, HEAD_DIM, ROT, dt)     # [1, HEAD_DIM]
    v_new = tl.load(V + seq * stride_vt + kv_head * HEAD_DIM + d)
    if (lo <= pos) & (pos < hi):            # the split that holds the new position writes it to the cache
        slot = tl.load(slot_mapping + seq).to(tl.int64)
        tl.store(KCache + slot * stride_ks + kv_head * HEAD_DIM + d, k_new)
        tl.store(VCache + slot * stride_ks + kv_head * HEAD_DIM + d, v_new)
    if PREFETCH:
        n = lo + tl.arange(0, BLOCK_N)
        new = (n == pos)[:, None]
        m_i, l_i, acc = _attend_tile(q, tl.where(new, k_new, k_old), tl.where(new, v_new, v_old), n, n < hi,
                                     tl.zeros([BLOCK_M], tl.int64) + pos, m_i, l_i, acc, scale, IEEE)
        start = lo + BLOCK_N
    for start in range(start, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        offs = _kv_offsets(table, n, n_ok, kv_head, dk, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        cached = (n_ok & (n < pos))[:, None]
        fresh = (n == pos)[:, None]
        k = tl.where(fresh, k_new, tl.load(KCache + offs, mask=cached, other=0.0))
        v = tl.where(fresh, v_new, tl.load(VCache + offs, mask=cached, other=0.0))
        m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, tl.zeros([BLOCK_M], tl.int64) + pos, m_i, l_i, acc, scale,
                                     IEEE)
    token = tl.zeros([BLOCK_M], tl.int64) + seq
    if NUM_SPLITS == 1:
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d,
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:   # partial results, [num_tokens, num_heads, NUM_SPLITS, (HEAD_DIM)], as paged_attention_triton lays them out
        row = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(PartAcc + row[:, None] * HEAD_DIM + d, acc, mask=row_ok[:, None])
        tl.store(PartM + row, m_i, mask=row_ok)
        tl.store(PartL + row, l_i, mask=row_ok)
        if LAST_COMBINES:
            _last_split_combines(Out, PartAcc, PartM, PartL, Counters, row - split, token, head, row_ok,
                                 seq * tl.num_programs(1) + kv_head, stride_ot, stride_oh, BLOCK_M, HEAD_DIM,
                                 NUM_SPLITS)


def rotary_decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                   sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                                   eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   meta: PagedAttentionMetadata, *, num_splits: int | None = None, pdl: bool = False,
                                   prefetch_kv: bool = True, split_counters: torch.Tensor | None = None
                                   ) -> torch.Tensor:
    """`minirt.kernels.rotary_triton.norm_rotate_and_store_triton` then `paged_attention_triton` on its q, for a
    batch of decodes, in one kernel (plus the split-KV combine kernel where splits are combined by a second launch).

    q `[1, T, H, D]`, k and v `[1, T, Hkv, D]`: the q/k/v projection's output before the q/k norm and rotation (each
    token's heads contiguous; tokens may be strided); cos/sin `[1, T, R]`; q_weight/k_weight `[D]` or both None; eps:
    as `norm_and_rotate_triton`. k_cache/v_cache `[num_blocks, block_size, Hkv, D]`, slot_mapping: as
    `store_kv_triton`. meta: a batch of T decodes (`max_query_len == 1`: sequence s's token is token s). Writes each
    token's rotated key and its value into its slot and returns the attention output `[1, T, H, D]`. num_splits,
    pdl, prefetch_kv, split_counters: as `paged_attention_triton` (num_splits None: `choose_num_splits`). Raises
    ValueError naming the argument for layouts it cannot read or a batch that is not all decodes.
    """
    _check(q, k, cos, sin, q_weight, k_weight)
    if q.shape[0] != 1:
        raise ValueError(f"q: must be a packed batch [1, num_tokens, H, D], got {tuple(q.shape)}")
    if meta.max_query_len != 1 or meta.context_lens.shape[0] != q.shape[1]:
        raise ValueError(f"meta: must be a batch of decodes, one token per sequence (max_query_len 1, "
                         f"{q.shape[1]} sequences), got max_query_len {meta.max_query_len}, "
                         f"{meta.context_lens.shape[0]} sequences")
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1 or v.stride(-2) != k.shape[-1]:
        raise ValueError(f"v: must be {k.dtype} of k's shape {tuple(k.shape)} with each token's heads contiguous, "
                         f"got {v.dtype} {tuple(v.shape)}, strides {tuple(v.stride())}")
    check_store_kv_args(k_cache, v_cache, k[0], v[0], meta.slot_mapping)
    _, num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = choose_num_splits(meta, num_kv_heads, q.device)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out[None]
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out                       # unused
    last_combines = num_splits > 1 and split_counters is not None
    if last_combines and (split_counters.dtype != torch.int32 or split_counters.device != q.device
                          or not split_counters.is_contiguous() or split_counters.numel() < num_tokens * num_kv_heads):
        raise ValueError(f"split_counters: must be a contiguous int32 tensor on {q.device} with at least "
                         f"{num_tokens * num_kv_heads} elements (sequences x KV heads), got {split_counters.dtype}, "
                         f"{split_counters.numel()} elements on {split_counters.device}")
    norm = q_weight is not None
    block_tables = meta.block_tables.contiguous()
    block_n, warps, stages = SPLIT_TILE if num_splits > 1 else DECODE_TILE
    launch = {"launch_pdl": True} if pdl else {}
    _rotary_decode_attention_kernel[(num_tokens, num_kv_heads, num_splits)](
        q, k, v, k_cache, v_cache, out, part_acc, part_m, part_l, split_counters if last_combines else out,
        cos, sin, q_weight if norm else q, k_weight if norm else k, eps,
        block_tables, meta.context_lens, meta.slot_mapping, head_dim ** -0.5,
        q.stride(1), k.stride(1), v.stride(1), cos.shape[-1], k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, ROT=cos.shape[-1], GROUP=group, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, NORM=norm, IEEE=q.dtype == torch.float32, PDL=pdl,
        PREFETCH=prefetch_kv and num_splits > 1, LAST_COMBINES=last_combines, num_warps=warps, num_stages=stages,
        **launch)
    if num_splits > 1 and not last_combines:
        _combine_splits_kernel[(num_tokens, num_heads)](out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
                                                        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PDL=pdl, **launch)
    return out[None]
