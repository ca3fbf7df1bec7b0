"""Paged attention as one Triton kernel: no gathered copy of the K/V, any mix of prefill chunks and decodes.

One program handles one sequence, one KV head and a tile of its new tokens. The query rows of the tile
are (token, query head of this KV head's group) pairs, so grouped-query attention reads each K/V block
once for the whole group. The program walks the sequence's block table `BLOCK_N` keys at a time and keeps
a running softmax (max, sum, weighted values), as FlashAttention does (Dao et al. 2022, algorithm 1;
vLLM's `unified_attention` Triton kernel and FlashInfer work the same way on paged K/V).

Same contract as `minirt.attention.paged_attention_reference`, which the tests compare it with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.attention import PagedAttentionMetadata


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out, block_tables, context_lens, query_start_loc, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP           # new tokens per tile
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    ctx = tl.load(context_lens + seq)

    r = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (tok < q_len) & (r < TOKENS * GROUP)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = ctx - q_len + tok                             # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last = tl.minimum(ctx, ctx - q_len + (tile + 1) * TOKENS)   # keys beyond the tile's last row are masked
    for start in range(0, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < last
        block = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        offs = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + offs[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))              # key 0 is in the first block: never -inf after it
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata) -> torch.Tensor:
    """q `[num_tokens, H, D]`, k/v cache `[num_blocks, block_size, Hkv, D]` -> `[num_tokens, H, D]`."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group
    out = torch.empty_like(q)
    grid = (meta.context_lens.shape[0], num_kv_heads, triton.cdiv(meta.max_query_len, tokens_per_tile))
    block_tables = meta.block_tables.contiguous()
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, meta.context_lens, meta.query_start_loc, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_N=64,
        IEEE=q.dtype == torch.float32)
    return out
