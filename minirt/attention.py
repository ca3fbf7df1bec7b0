"""Attention: the one place where the generation strategies differ.

The model (`minirt.model.decoder`) computes q, k, v for a batch of tokens and hands them to an
*attention backend*: any callable `attn(layer_idx, q, k, v) -> out` with

    q    [B, T, num_heads, head_dim]
    k, v [B, T, num_kv_heads, head_dim]     (num_heads % num_kv_heads == 0: grouped-query attention)
    out  [B, T, num_heads, head_dim]

Where the keys and values of earlier tokens live is the backend's business:

* `CausalAttention` - nowhere: every step re-runs the whole prefix (chapter 01, the naive loop);
* `minirt.generate.kv_cache.ContiguousKVCache` - one preallocated `[B, max_len]` slab per row (chapter 02);
* `PagedAttention` (this file) - fixed-size blocks of one shared pool, found through a block table
  (chapter 03; Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention", section 4).

`torch.nn.functional.scaled_dot_product_attention` (SDPA) is the reference kernel throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds a new execution plan for every new shape (~1 ms of CPU per call), and paged
# batches change shape every step; the other backends do not.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """Grouped-query SDPA in the `[B, T, heads, head_dim]` layout used by the model.

    q `[B, Tq, H, D]`, k/v `[B, Tk, Hkv, D]`, mask `[B, 1, Tq, Tk]` bool (True = may attend) or None.
    Returns `[B, Tq, H, D]`. Scale is `head_dim ** -0.5`.
    """
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
    if q.is_cuda:
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(*args, **kwargs).transpose(1, 2)
    return F.scaled_dot_product_attention(*args, **kwargs).transpose(1, 2)


class CausalAttention:
    """No cache: each call sees the whole sequence, with a causal mask.

    An optional `padding_mask` `[B, T]` (1 = real token, 0 = left padding) keeps padded keys out.
    """

    def __init__(self, padding_mask: torch.Tensor | None = None):
        self.padding_mask = padding_mask

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.padding_mask is None:
            return sdpa(q, k, v, is_causal=q.shape[1] > 1)
        T = q.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal[None, None] & self.padding_mask.bool()[:, None, None, :]
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)  # padded rows attend to themselves
        return sdpa(q, k, v, mask=mask)


# ----------------------------------------------------------------------------------- paged attention


@dataclass
class PagedAttentionMetadata:
    """How a packed batch of `num_seqs` sequences maps onto the paged KV cache.

    The batch is packed: the new tokens of all sequences stand one after another, `[1, num_tokens]`
    (no padding), sequence `s` owning tokens `query_start_loc[s] : query_start_loc[s+1]`.

    slot_mapping    `[num_tokens]` int64: where each new token's K/V is written, as a flat slot
                    `block_id * block_size + offset`.
    query_start_loc `[num_seqs + 1]` int64: cumulative query lengths (vLLM's and flash-attn's `cu_seqlens_q`).
    context_lens    `[num_seqs]` int64: tokens of each sequence in the cache *after* this step's write
                    (cached prefix + new tokens).
    block_tables    `[num_seqs, max_blocks]` int64: the physical block of each logical block, padded with 0.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into their slots.

    k_cache/v_cache `[num_blocks, block_size, Hkv, D]`; k/v `[num_tokens, Hkv, D]`; slot_mapping `[num_tokens]`.
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache `[num_blocks, block_size, Hkv, D]`, slots `[...]` -> `[..., Hkv, D]`, the K or V in those slots.

    `index_select` rather than `cache[slots]`: the same copy, faster on the CPU.
    """
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata) -> torch.Tensor:
    """Attention of packed queries over their sequences' paged K/V, in plain torch.

    q `[num_tokens, H, D]` -> `[num_tokens, H, D]`. Query `i` of sequence `s` sits at absolute
    position `context_lens[s] - q_len[s] + i` and attends to keys `0 .. that position`.

    The K/V of each sequence are gathered through its block table into a padded `[num_seqs, max_context_len]`
    batch, then one masked SDPA call runs. Simple and exact; GPU kernels avoid the gather.
    """
    device = q.device
    block_size = k_cache.shape[1]
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]

    # Gather K/V: logical position j of sequence s lives in slot block_tables[s, j // B] * B + j % B.
    pos = torch.arange(meta.max_context_len, device=device)
    blocks = meta.block_tables[:, pos // block_size]                      # [S, max_ctx]
    slots = blocks * block_size + pos % block_size
    k = gather_slots(k_cache, slots)                                        # [S, max_ctx, Hkv, D]
    v = gather_slots(v_cache, slots)

    # Unpack the queries into [S, max_q, H, D].
    qi = torch.arange(meta.max_query_len, device=device)
    q_valid = qi[None, :] < q_lens[:, None]                                 # [S, max_q]
    token_idx = (meta.query_start_loc[:-1, None] + qi[None, :]).clamp(max=q.shape[0] - 1)
    qb = q[token_idx]                                                       # [S, max_q, H, D]

    # Causal mask in absolute positions; padded query rows may see every real key (their output is dropped).
    q_pos = (meta.context_lens - q_lens)[:, None] + qi[None, :]            # [S, max_q]
    k_real = pos[None, :] < meta.context_lens[:, None]                     # [S, max_ctx]
    mask = (pos[None, None, :] <= q_pos[:, :, None]) | ~q_valid[:, :, None]
    mask = (mask & k_real[:, None, :])[:, None]                            # [S, 1, max_q, max_ctx]

    out = sdpa(qb, k, v, mask=mask)                                        # [S, max_q, H, D]
    return out[q_valid]                                                     # [num_tokens, H, D]


class PagedAttention:
    """Attention backend over one preallocated paged KV cache (see `minirt.kv.paged_cache`).

    `kv_cache` `[num_layers, 2, num_blocks, block_size, Hkv, D]`. Each call writes the new tokens' K/V into
    their slots (`store_kv`), then attends over each sequence's whole context (`paged_attention_reference`).
    """

    def __init__(self, kv_cache: torch.Tensor, meta: PagedAttentionMetadata):
        self.kv_cache = kv_cache
        self.meta = meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError(f"q: paged attention takes a packed batch [1, num_tokens, ...], got {tuple(q.shape)}")
        k_cache, v_cache = self.kv_cache[layer_idx]
        store_kv(k_cache, v_cache, k[0], v[0], self.meta.slot_mapping)
        return paged_attention_reference(q[0], k_cache, v_cache, self.meta)[None]
