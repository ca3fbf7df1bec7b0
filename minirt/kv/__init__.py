"""Chapters 03-04: paged KV blocks and the prefix cache."""

from minirt.kv.block_pool import Block, BlockPool
from minirt.kv.paged_cache import allocate_kv_cache, kv_bytes_per_token, slot_mapping
from minirt.kv.prefix_cache import PrefixCache, block_hashes

__all__ = ["Block", "BlockPool", "PrefixCache", "block_hashes", "allocate_kv_cache", "kv_bytes_per_token",
           "slot_mapping"]
