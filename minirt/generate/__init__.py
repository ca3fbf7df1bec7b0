"""Chapters 01-02: generation without an engine - the naive loop and the contiguous KV cache."""

from minirt.generate.kv_cache import ContiguousKVCache, kv_cache_generate, left_pad
from minirt.generate.naive import naive_generate

__all__ = ["naive_generate", "kv_cache_generate", "ContiguousKVCache", "left_pad"]
