"""Which paged-attention kernel and K/V write run, and the torch references of the split-KV combine and of decode
attention with the rotation in front (chapter 07)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from minirt.attention import PagedAttention, PagedAttentionMetadata, paged_attention_reference, store_kv
from minirt.fast.ops import norm_rotate_and_store


class KernelPagedAttention(PagedAttention):
    """`minirt.attention.PagedAttention` with a chosen attention kernel and K/V write (each with the contract of
    `paged_attention_reference` and `store_kv`), and `attend` for a caller that has written this step's K/V
    itself (the rotary kernel's K/V write, `minirt.fast.layers.FastAttention`)."""

    def __init__(self, kv_cache: torch.Tensor, meta: PagedAttentionMetadata, kernel=paged_attention_reference,
                 store=store_kv):
        super().__init__(kv_cache, meta)
        self.kernel, self.store = kernel, store
        self.prepared = None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError(f"q: paged attention takes a packed batch [1, num_tokens, ...], got {tuple(q.shape)}")
        k_cache, v_cache = self.kv_cache[layer_idx]
        self.store(k_cache, v_cache, k[0], v[0], self.meta.slot_mapping)
        return self.attend(layer_idx, q)

    def attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention alone over layer `layer_idx`'s cache, whose slots `meta.slot_mapping` already hold this step's
        K/V. q `[1, num_tokens, H, D]` -> `[1, num_tokens, H, D]`.

        A kernel with `prepare(meta)` and `run(q, k_cache, v_cache, prepared)` (flash-attn's,
        `minirt.fast.flash_attn`) gets its metadata prepared once per forward, at layer 0, where every forward
        starts: also inside a CUDA graph's capture, and again in each step of a multi-step burst, whose inputs
        move on in place."""
        k_cache, v_cache = self.kv_cache[layer_idx]
        prepare = getattr(self.kernel, "prepare", None)
        if prepare is None:
            return self.kernel(q[0], k_cache, v_cache, self.meta)[None]
        if layer_idx == 0 or self.prepared is None:
            self.prepared = prepare(self.meta)
        return self.kernel.run(q[0], k_cache, v_cache, self.prepared)[None]

    def rotates(self) -> bool:
        """True where `rotate_and_attend` runs: a batch of decodes, with a kernel that rotates (`RotaryInAttention`)."""
        return self.meta.max_query_len == 1 and isinstance(self.kernel, RotaryInAttention)

    def rotate_and_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
        """Attention over layer `layer_idx`'s cache for q/k/v as the projection left them: the q/k norm, the rotation
        and this step's K/V write first, all in the kernel (`rotate_store_and_attend`'s contract). Only where
        `rotates()`."""
        k_cache, v_cache = self.kv_cache[layer_idx]
        return self.kernel.rotate_and_attend(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, self.meta)


def rotate_store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                            attend: Callable = paged_attention_reference) -> torch.Tensor:
    """Qwen3's q/k norm and the rotation (weights None: no norm), this step's K/V write, then paged attention, in
    plain torch: the contract of `RotaryInAttention.rotate_and_attend`, which
    `minirt.kernels.rotary_attention_triton.rotary_decode_attention_triton` fulfils in one kernel for batches of
    decodes. q `[1, T, H, D]`, k/v `[1, T, Hkv, D]`, cos/sin `[1, T, R]`, caches `[num_blocks, block_size, Hkv, D]`
    -> `[1, T, H, D]`."""
    q = norm_rotate_and_store(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, meta.slot_mapping)
    return attend(q[0], k_cache, v_cache, meta)[None]


@dataclass(frozen=True)
class RotaryInAttention:
    """An attention kernel (`paged_attention_reference`'s contract, for every step) with a twin for batches of
    decodes that takes q/k/v before the q/k norm and rotation (`rotate_store_and_attend`'s contract): chapter 07's
    rotary_in_attention, one kernel per layer where the rotary kernel and attention take two."""

    attend: Callable
    rotate_and_attend: Callable

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedAttentionMetadata) -> torch.Tensor:
        return self.attend(q, k_cache, v_cache, meta)


def attention_kernels(plan, device: torch.device, max_num_seqs: int, num_kv_heads: int):
    """`(kernel, store)` for a plan (`minirt.fast.plan.Plan`): the torch reference; flash-attn's kernel
    (`minirt.fast.flash_attn`) with the Triton K/V write; or the Triton kernels of
    `minirt.kernels.paged_attention_triton` with the plan's split-KV, PDL, K/V prefetch and in-kernel combine, and
    with rotary_in_attention its twin that rotates (`RotaryInAttention`).

    The K/V prefetch reads earlier steps' K/V before its PDL wait. That is safe because every forward pass of
    `minirt.model.decoder.DecoderModel` starts with torch's embedding gather, launched without PDL, which starts
    only once every kernel before it has finished: earlier steps' K/V is final by then."""
    if plan.attention_backend == "torch":
        return paged_attention_reference, store_kv
    from minirt.kernels import triton_missing

    if plan.attention_backend == "flash_attn":
        from minirt.fast.flash_attn import flash_attn_kernel

        if triton_missing(device):
            return flash_attn_kernel(), store_kv
        from minirt.kernels.paged_attention_triton import store_kv_triton

        return flash_attn_kernel(), functools.partial(store_kv_triton, pdl=plan.pdl)
    from minirt.kernels.paged_attention_triton import paged_attention_triton, split_counters_for, store_kv_triton

    options = {"pdl": plan.pdl, "prefetch_kv": plan.prefetch_kv}
    if not plan.split_kv:
        options["num_splits"] = 1
    if plan.combine_in_attention:
        options["split_counters"] = split_counters_for(max_num_seqs, num_kv_heads, device)
    kernel = functools.partial(paged_attention_triton, **options)
    if plan.rotary_in_attention:
        from minirt.kernels.rotary_attention_triton import rotary_decode_attention_triton

        kernel = RotaryInAttention(kernel, functools.partial(rotary_decode_attention_triton, **options))
    return kernel, functools.partial(store_kv_triton, pdl=plan.pdl)


def combine_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Exact attention output from split-KV partial results (flash-decoding; Dao et al. 2023).

    Split `j` of a query's keys kept its running softmax over its share of the keys: `m[..., j]` the
    largest score, `l[..., j] = sum exp(score - m_j)`, `acc[..., j, :] = sum exp(score - m_j) * value`.
    acc `[..., num_splits, head_dim]`, m and l `[..., num_splits]` (float32) -> `[..., head_dim]`:

        out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j,   M = max_j m_j.

    A split with no keys has m = -inf, l = 0, acc = 0 and weight 0. The torch reference of the Triton
    kernel's `_combine_splits_kernel` (`minirt.kernels.paged_attention_triton`).
    """
    weights = torch.exp(m - m.amax(dim=-1, keepdim=True))                 # [..., num_splits]
    return (weights[..., None] * acc).sum(dim=-2) / (weights * l).sum(dim=-1, keepdim=True)
