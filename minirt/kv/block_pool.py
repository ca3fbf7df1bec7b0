"""Chapter 03: the block pool - fixed-size KV blocks, a free list and reference counts.

The KV cache is one preallocated tensor cut into `num_blocks` blocks of `block_size` token slots.
A request owns a *block table*: the list of physical blocks holding its logical blocks 0, 1, 2, ...
Memory is handed out a block at a time, so a request wastes at most `block_size - 1` slots instead
of `max_model_len - its length` (Kwon et al. 2023, "PagedAttention", section 4.2; vLLM's
`BlockPool`, nano-vllm's `BlockManager`).

Reference counts let several block tables share one block (the prefix cache, chapter 04). A block
whose count falls to zero goes back to the *end* of the free list but keeps its contents and hash:
it can still be revived by a prefix-cache hit until it is handed out again, which evicts the
least recently freed block first (vLLM V1's free-block queue).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None            # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = field(default=())   # the tokens it holds when hashed (for the equality check)


class BlockPool:
    """Owns the blocks: allocate, share, free. Nothing here touches tensors.

    Invariants: a block is in the free list iff its ref_count is 0; `cached` maps each registered
    hash to the one block holding it.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}      # block_hash -> block_id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references - including cached ones, which are evicted on demand."""
        return len(self.free)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached contents). Raises RuntimeError if none."""
        if not self.free:
            raise RuntimeError("no free KV block")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:                     # evict from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference to a block (a prefix-cache hit), reviving it from the free list if needed."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block joins the end of the free list (contents kept)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def release_all(self, block_table: list[int]) -> None:
        """Free a request's blocks, last block first, so that its prefix stays cached longest."""
        for block_id in reversed(block_table):
            self.release(block_id)
        block_table.clear()
