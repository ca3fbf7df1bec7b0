"""Chapter 11: give back the KV blocks of rejected draft tokens.

The target writes the K/V of every drafted token into the request's blocks before it knows which are kept;
after acceptance only the first `num_tokens` slots hold tokens of the sequence. The slots past them are
simply overwritten later, but whole blocks past them are released to the pool, so that a rejected run never
holds memory. Release, not free: a block may be shared (a prefix-cache hit held by another request too),
and its reference count decides when it is free (vLLM's `KVCacheManager` frees a request's blocks the same
way). A block holding any rejected token is never hashed: the prefix cache registers only blocks full of
computed, kept tokens (`PrefixCache.register` is called with the accepted length).
"""

from __future__ import annotations

from minirt.kv.block_pool import BlockPool


def rollback_block_table(block_table: list[int], pool: BlockPool, num_tokens: int, block_size: int) -> list[int]:
    """Keep the blocks holding the first `num_tokens` tokens; release the rest. Returns the released ids.

    block_table: the request's physical block ids, edited in place (truncated to ceil(num_tokens / block_size)
    entries); pool: the `BlockPool` whose reference counts are dropped by one per released block, last block
    first (as `BlockPool.release_all`). Raises ValueError for num_tokens < 0 or block_size < 1.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    keep = -(-num_tokens // block_size)                     # ceil: a partly filled last block stays
    released = block_table[keep:]
    for block_id in reversed(released):
        pool.release(block_id)
    del block_table[keep:]
    return released
