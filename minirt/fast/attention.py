"""Which paged-attention kernel and K/V write run, and the split-KV combine's torch reference (chapter 07)."""

from __future__ import annotations

import functools

import torch

from minirt.attention import PagedAttention, PagedAttentionMetadata, paged_attention_reference, store_kv


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


def attention_kernels(plan, device: torch.device, max_num_seqs: int, num_kv_heads: int):
    """`(kernel, store)` for a plan (`minirt.fast.plan.Plan`): the torch reference; flash-attn's kernel
    (`minirt.fast.flash_attn`) with the Triton K/V write; or the Triton kernels of
    `minirt.kernels.paged_attention_triton` with the plan's split-KV, PDL, K/V prefetch and in-kernel combine.

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
    return functools.partial(paged_attention_triton, **options), functools.partial(store_kv_triton, pdl=plan.pdl)


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


def verify_kernel(plan, kernel, max_num_seqs: int, query_len: int, num_kv_heads: int, device: torch.device):
    """The attention kernel of the verification graphs (`minirt.fast.cuda_graphs.DecodeGraphs` with `query_len`
    k + 1 rows per sequence, batches of up to `max_num_seqs`): `kernel`, the plan's (`attention_kernels`), except
    that the Triton kernel with split-KV splits each sequence's keys as it would for a decode batch of as many
    sequences (`splits_for`), and with the combine in the attention kernel counts on counters of its own, one per
    (sequence, KV head, query tile). `choose_num_splits` keeps one program per sequence for a step with several rows
    per sequence, which it cannot tell from a prefill chunk; here the graphs say the rows are uniform and few. The
    kernel handles them as it handles a chunk's (each row's position `context_len - q_len + i`, the causal mask),
    and its K/V prefetch before the PDL wait loads only keys before the step's first row, written by earlier steps."""
    if plan.attention_backend != "triton" or not plan.split_kv:
        return kernel
    from minirt.kernels.paged_attention_triton import split_counters_for, splits_for

    options = {}
    if plan.combine_in_attention:                 # query tiles per sequence: at most one per row
        options["split_counters"] = split_counters_for(max_num_seqs * query_len, num_kv_heads, device)

    def split_kv_kernel(q, k_cache, v_cache, meta):
        splits = splits_for(meta.context_lens.shape[0] * num_kv_heads, q.device)
        return kernel(q, k_cache, v_cache, meta, num_splits=splits, **options)

    return split_kv_kernel
