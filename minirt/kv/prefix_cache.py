"""Chapter 04: the prefix cache - reuse the KV of full blocks that another request already computed.

Each *full* block gets a hash that chains in everything before it:
`hash_i = hash((hash_{i-1}, tokens of block i))`, so equal hashes mean equal whole prefixes, not just
equal blocks. A new request walks its prompt block by block and takes every block whose hash is
cached (adding a reference) until the first miss; it then computes only the rest.
Ideas from SGLang's RadixAttention (Zheng et al. 2024, section 3) and vLLM V1's hash-chained
prefix caching; nano-vllm does the same with xxhash plus a token check.

Two rules keep it correct:
* a hit is confirmed by comparing the stored tokens, so a hash collision can never serve wrong KV;
* the last prompt token is always recomputed (at most `(len(prompt) - 1) // block_size` blocks can
  hit), because its logits are needed to sample the first output token.
"""

from __future__ import annotations

from minirt.kv.block_pool import BlockPool

#: The parent hash of the first block. A fixed integer (not `hash(None)`, which varies between processes
#: on Python < 3.12) keeps the chain reproducible: ints and tuples of ints hash the same in every run.
ROOT_HASH = 0


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The chained hashes of the first `num_blocks` full blocks of `token_ids` (all full blocks if None)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes, parent = [], ROOT_HASH
    for i in range(n):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Lookup and registration of full blocks in a `BlockPool`'s hash table."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.queries = 0          # prompt tokens looked up
        self.hits = 0             # prompt tokens served from the cache

    def match(self, prompt_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of the prompt (no references taken yet).

        Considers at most `(len(prompt_ids) - 1) // block_size` blocks, so the last token is always computed.
        """
        if not self.enabled:
            return []
        B = self.block_size
        matched: list[int] = []
        for i, h in enumerate(block_hashes(prompt_ids, B, (len(prompt_ids) - 1) // B)):
            block_id = self.pool.cached.get(h)
            if block_id is None or self.pool.blocks[block_id].token_ids != tuple(prompt_ids[i * B:(i + 1) * B]):
                break
            matched.append(block_id)
        return matched

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    def register(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int,
                 num_registered: int) -> int:
        """Hash every block that became full with computed KV since the last call.

        token_ids: the request's tokens (prompt + output); blocks `num_registered .. num_computed_tokens // B`
        are registered. Returns the new count of registered blocks. A hash already held by another block
        is left pointing there (the duplicate is simply not shared).
        """
        if not self.enabled:
            return num_registered
        B = self.block_size
        full = num_computed_tokens // B
        if full <= num_registered:
            return num_registered
        parent = self.pool.blocks[block_table[num_registered - 1]].block_hash if num_registered else ROOT_HASH
        for i in range(num_registered, full):
            tokens = tuple(token_ids[i * B:(i + 1) * B])
            parent = hash((parent, tokens))
            block = self.pool.blocks[block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = parent, tokens
                self.pool.cached.setdefault(parent, block.block_id)
        return full
