"""Chapter 03: the one preallocated KV tensor, and the slot mapping into it.

Layout `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`: a token's K/V for
every layer sits at the same *slot* `block_id * block_size + offset`, so one slot mapping per step
serves all layers (vLLM's and nano-vllm's layout).
"""

from __future__ import annotations

import torch

from minirt.model.layers import head_dim_of


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers: `2 * layers * kv_heads * head_dim * dtype size`."""
    head_dim = head_dim_of(config)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def allocate_kv_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The zero-filled KV tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""
    head_dim = head_dim_of(config)
    shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of logical positions `start .. end-1` of a sequence with this block table.

    Position p lives in block `block_table[p // block_size]` at offset `p % block_size`.
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
