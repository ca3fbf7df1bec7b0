"""Chapters 05-06: the scheduler - who gets admitted, and how each step's token budget is spent.

It owns the three collections and decides; the model runner computes; the block pool owns the
blocks (nano-vllm's split). Each step:

1. **decode**: every running request gets one token, oldest first - decodes go first so that
   running requests never stall behind a long prompt (Sarathi-Serve's "stall-free batching",
   Agrawal et al. 2024, section 4.2; vLLM V1 schedules running requests first too);
2. **prefill**: admitted requests continue their prompts in chunks of at most `max_prefill_chunk`
   tokens (chunked prefill, Sarathi-Serve section 4.1);
3. **admit**: while there are seats (`max_num_seqs`), budget and blocks, the head of the waiting
   queue is moved to prefilling and gets its first chunk.

All of it stays within `max_num_batched_tokens` tokens.

Blocks: admission reserves only what the prompt needs; a decode takes a new block when its last
one is full. When none is free, the scheduler **preempts by recompute** (vLLM V1; Kwon et al. 2023,
section 4.5): the newest admitted request gives all its blocks back and returns to the *head* of the
waiting queue with the tokens it has generated; when readmitted, it prefills prompt + output again
(full blocks it left in the prefix cache are hits) and carries on exactly where it stopped.
Admission is first come, first served: a request that does not fit waits at the head of the queue
(later ones do not overtake it and starve it). Every request fits in the empty pool (checked at
submission), and the oldest running request can always preempt the others, so every request finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minirt.config import EngineConfig, cdiv
from minirt.kv.block_pool import BlockPool
from minirt.kv.prefix_cache import PrefixCache
from minirt.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: `(request, num_new_tokens)` pairs, decodes first, then prefill chunks.

    Each request computes tokens `token_ids[num_computed_tokens : num_computed_tokens + n]`.
    """

    items: list[tuple[Request, int]] = field(default_factory=list)
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def blocks_needed(num_prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at most: enough for `prompt + max_new_tokens` tokens."""
    return cdiv(num_prompt_tokens + max_new_tokens, block_size)


def split_budget(budget: int, num_decodes: int, remaining_prompts: list[int], max_prefill_chunk: int
                 ) -> tuple[int, list[int]]:
    """The token-budget rule on its own: decodes first (1 token each), then prompt chunks in order.

    remaining_prompts: prompt tokens still to compute, per prefilling request, in admission order.
    Returns (decodes scheduled, chunk per prefilling request); chunks are `min(remaining, cap, budget left)`.
    """
    decodes = min(num_decodes, budget)
    left = budget - decodes
    chunks = []
    for remaining in remaining_prompts:
        chunk = min(remaining, max_prefill_chunk, left)
        chunks.append(chunk)
        left -= chunk
    return decodes, chunks


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, prefix_cache: PrefixCache):
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.waiting_queue: deque[Request] = deque()
        self.prefilling_requests: list[Request] = []
        self.running_requests: list[Request] = []
        self.num_preemptions = 0
        self.num_preempted_recomputed_tokens = 0   # tokens prefilled again after a preemption
        # vLLM's watermark: admission leaves ~1% of the pool free for running decodes, to avoid thrashing.
        self.watermark_blocks = pool.num_blocks // 100

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.prefilling_requests or self.running_requests)

    def add(self, request: Request) -> None:
        self.waiting_queue.append(request)

    # ------------------------------------------------------------------ admission
    def try_allocate(self, request: Request) -> bool:
        """Give a request blocks for all its known tokens (prefix-cache hits first), or return False.

        Known tokens are the prompt, plus the output so far for a preempted request: all are prefilled.
        Outside an empty engine, `watermark` blocks stay free so running requests can still decode.
        `num_cached_tokens` and the prefix-cache counters count the first admission only (vLLM's
        `num_cached_tokens` too): a preempted request's recomputation goes to `num_preempted_recomputed_tokens`.
        """
        B = self.config.block_size
        hits = self.prefix_cache.match(request.token_ids)
        total = cdiv(len(request.token_ids), B)
        revived = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)   # hits now sitting in the free list
        busy = self.prefilling_requests or self.running_requests
        watermark = self.watermark_blocks if busy else 0
        if total - len(hits) > self.pool.num_free_blocks - revived - watermark:
            return False
        for b in hits:
            self.pool.acquire(b)
        request.block_table = hits + [self.pool.allocate() for _ in range(total - len(hits))]
        request.num_computed_tokens = len(hits) * B
        request.num_registered_blocks = len(hits)
        request.num_prefill_tokens = len(request.token_ids)
        if request.num_preemptions == 0:       # the prompt's hits count once, at its first admission
            request.num_cached_tokens = request.num_computed_tokens
            self.prefix_cache.record(len(request.token_ids), request.num_cached_tokens)
        else:                                  # re-admission after preemption: recomputation, counted apart
            self.num_preempted_recomputed_tokens += len(request.token_ids) - request.num_computed_tokens
        return True

    def ensure_decode_slot(self, request: Request) -> bool:
        """Make sure the block table has a slot for the token this decode writes, preempting the newest
        requests if the pool is empty. Returns False if `request` itself had to be preempted."""
        need = cdiv(request.num_computed_tokens + 1, self.config.block_size)
        while len(request.block_table) < need:
            if self.pool.num_free_blocks > 0:
                request.block_table.append(self.pool.allocate())
                continue
            victim = self.prefilling_requests[-1] if self.prefilling_requests else self.running_requests[-1]
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Preemption by recompute: free all blocks, back to the head of the waiting queue, tokens kept."""
        self.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting_queue.appendleft(request)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        """Decide this step's batch (see the module docstring). Moves admitted requests to prefilling."""
        cfg = self.config
        batch = ScheduledBatch()
        i = 0
        while i < len(self.running_requests) and batch.num_decodes < cfg.max_num_batched_tokens:
            request = self.running_requests[i]
            if self.ensure_decode_slot(request):     # may preempt newer requests, or this one
                batch.items.append((request, 1))
                batch.num_decodes += 1
                i += 1
        _, chunks = split_budget(
            cfg.max_num_batched_tokens, batch.num_decodes,
            [r.num_prefill_tokens - r.num_computed_tokens for r in self.prefilling_requests], cfg.max_prefill_chunk)
        batch.items += [(r, n) for r, n in zip(self.prefilling_requests, chunks) if n > 0]
        budget = cfg.max_num_batched_tokens - batch.num_tokens

        while (self.waiting_queue and budget > 0
               and len(self.prefilling_requests) + len(self.running_requests) < cfg.max_num_seqs):
            request = self.waiting_queue[0]
            if not self.try_allocate(request):
                break                                    # head-of-line waits; nobody overtakes it
            self.waiting_queue.popleft()
            request.status = RequestStatus.PREFILLING
            self.prefilling_requests.append(request)
            n = min(request.num_prefill_tokens - request.num_computed_tokens, cfg.max_prefill_chunk, budget)
            batch.items.append((request, n))
            budget -= n
        return batch

    def update_after_step(self, request: Request, num_new_tokens: int) -> None:
        """Account for computed tokens; a request whose prompt is done moves prefilling -> running."""
        request.num_computed_tokens += num_new_tokens
        request.num_registered_blocks = self.prefix_cache.register(
            request.token_ids, request.block_table, request.num_computed_tokens, request.num_registered_blocks)
        if request.status == RequestStatus.PREFILLING and request.num_computed_tokens == request.num_prefill_tokens:
            self.prefilling_requests.remove(request)
            request.status = RequestStatus.RUNNING
            self.running_requests.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever collection holds it and free its blocks."""
        if request.status == RequestStatus.WAITING and request in self.waiting_queue:
            self.waiting_queue.remove(request)
        elif request.status == RequestStatus.PREFILLING and request in self.prefilling_requests:
            self.prefilling_requests.remove(request)
        elif request.status == RequestStatus.RUNNING and request in self.running_requests:
            self.running_requests.remove(request)
        self.pool.release_all(request.block_table)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests and chapter checks).

        Waiting requests hold no blocks; each block's reference count equals the number of block tables
        holding it; a block is in the free list iff nobody holds it; every cache entry points at a block
        that carries that hash; each admitted request has blocks for the tokens it has computed.
        """
        holders: dict[int, int] = {}
        for r in self.waiting_queue:
            assert not r.block_table, f"waiting request {r.request_id} holds blocks {r.block_table}"
        for r in [*self.prefilling_requests, *self.running_requests]:
            assert len(r.block_table) * self.config.block_size >= r.num_computed_tokens, \
                f"request {r.request_id}: {r.num_computed_tokens} computed tokens but {len(r.block_table)} blocks"
            for b in r.block_table:
                holders[b] = holders.get(b, 0) + 1
        for block in self.pool.blocks:
            held = holders.get(block.block_id, 0)
            assert block.ref_count == held, f"block {block.block_id}: ref_count {block.ref_count}, held by {held}"
            assert (block.block_id in self.pool.free) == (held == 0), f"block {block.block_id}: free-list mismatch"
        for h, b in self.pool.cached.items():
            assert self.pool.blocks[b].block_hash == h, f"cache entry for block {b} has a stale hash"

