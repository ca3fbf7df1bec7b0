"""Chapter 02: a contiguous KV cache and a static batch.

Keys and values of past tokens never change, so we keep them: one preallocated slab
`[B, num_kv_heads, max_len, head_dim]` per layer for keys and one for values. *Prefill* runs the
whole (left-padded) prompt batch once and fills the slab; each *decode* step then feeds one new
token per row and attends over the slab. Total work drops from quadratic to linear in length.

A static batch pads prompts on the left so that every row's next token lands in the same column;
each row keeps its own positions (`cumsum(attention_mask) - 1`) so RoPE sees the true distance, and
padded columns are masked out of attention. This is what `transformers`' `generate` does.
"""

from __future__ import annotations

import torch

from minirt.attention import sdpa
from minirt.model.decoder import DecoderModel
from minirt.model.layers import head_dim_of


class ContiguousKVCache:
    """Per-layer K/V slabs for a static batch, and the attention backend that uses them.

    k[layer], v[layer]: `[B, max_len, num_kv_heads, head_dim]`. `padding_mask` `[B, max_len]` marks real
    tokens (1) versus left padding (0). `length` is the number of filled columns.
    Bytes: `2 * num_layers * B * max_len * num_kv_heads * head_dim * dtype_size`.
    """

    def __init__(self, model: DecoderModel, batch_size: int, max_len: int):
        cfg = model.config
        num_kv_heads = cfg.num_key_value_heads
        head_dim = head_dim_of(cfg)
        shape = (cfg.num_hidden_layers, batch_size, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.padding_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=model.device)
        self.length = 0

    def append(self, padding_mask: torch.Tensor) -> None:
        """Announce the next `T` columns (before the forward): padding_mask `[B, T]`."""
        T = padding_mask.shape[1]
        self.padding_mask[:, self.length:self.length + T] = padding_mask.bool()
        self._start = self.length
        self.length += T

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self._start, self.length
        self.k[layer_idx, :, start:end] = k
        self.v[layer_idx, :, start:end] = v
        # Query column start+i may see key column j <= start+i, if column j holds a real token.
        T = end - start
        cols = torch.arange(end, device=q.device)
        causal = cols[None, :] <= (start + torch.arange(T, device=q.device))[:, None]      # [T, end]
        mask = causal[None, None] & self.padding_mask[:, None, None, :end]               # [B, 1, T, end]
        mask = mask | (cols[None, None, None, :] == (start + torch.arange(T, device=q.device))[None, None, :, None])
        return sdpa(q, self.k[layer_idx, :, :end], self.v[layer_idx, :, :end], mask=mask)


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad a list of prompts -> (input_ids `[B, T]`, padding_mask `[B, T]`, 1 = real token)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def kv_cache_generate(model: DecoderModel, prompts: list[list[int]], max_new_tokens: int,
                      eos_token_id: int | None = None) -> list[list[int]]:
    """Greedy decoding of a static batch with a contiguous KV cache: one prefill, then one token per step.

    prompts: B non-empty lists of token ids (lengths may differ). Returns B lists of generated ids;
    a row that produces `eos_token_id` stops there (EOS included) while the others go on.
    Raises ValueError on an empty batch, an empty prompt or `max_new_tokens < 1`.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, and every prompt at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    device = model.device
    input_ids, padding_mask = (t.to(device) for t in left_pad(prompts))
    B, T = input_ids.shape
    cache = ContiguousKVCache(model, B, T + max_new_tokens)
    positions = (padding_mask.cumsum(-1) - 1).clamp(min=0)                      # per-row positions
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)

    for step in range(max_new_tokens):
        cache.append(padding_mask)
        hidden = model(input_ids, positions, attn=cache)                           # prefill, then [B, 1]
        next_ids = model.compute_logits(hidden[:, -1]).argmax(-1)                  # [B]
        for i, tok in enumerate(next_ids.tolist()):
            if not done[i]:
                outputs[i].append(tok)
        if eos_token_id is not None:
            done |= next_ids == eos_token_id
        if bool(done.all()):
            break
        input_ids = next_ids[:, None]
        positions = positions[:, -1:] + 1
        padding_mask = torch.ones(B, 1, dtype=torch.long, device=device)
    return outputs
