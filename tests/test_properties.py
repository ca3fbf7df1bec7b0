"""Property-based tests (hypothesis): the block pool and prefix cache against a simple model, and the
scheduler's budget and chunk rules against brute force."""

from __future__ import annotations

from collections import Counter

from hypothesis import example, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minirt.config import EngineConfig
from minirt.fast.multi_step import BurstScheduler
from minirt.kv import BlockPool, PrefixCache, block_hashes
from minirt.request import Request
from minirt.sampling import SamplingParams
from minirt.scheduler import Scheduler, split_budget

BLOCK = 2


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork-by-prefix / free / evict sequences on a BlockPool + PrefixCache.

    The model: each live "sequence" is (tokens, block_table); a block's refcount must equal the number
    of tables holding it, the free count the number of unheld blocks, and a prefix match must return
    blocks whose stored tokens equal the prompt's, in order, never covering the last token.
    """

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12)
        self.cache = PrefixCache(self.pool, BLOCK)
        self.seqs: list[tuple[list[int], list[int], int]] = []   # tokens, table, registered blocks

    def _admit(self, tokens: list[int]) -> None:
        hits = self.cache.match(tokens)
        need = -(-len(tokens) // BLOCK) - len(hits)
        revived = sum(self.pool.blocks[b].ref_count == 0 for b in hits)
        if need > self.pool.num_free_blocks - revived:
            return
        for b in hits:
            self.pool.acquire(b)
        table = hits + [self.pool.allocate() for _ in range(need)]
        registered = self.cache.register(tokens, table, len(tokens), len(hits))
        self.seqs.append((tokens, table, registered))

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def allocate(self, tokens):
        self._admit(tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork_by_prefix(self, data):
        tokens, _, _ = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        tail = data.draw(st.lists(st.integers(0, 3), max_size=4))
        self._admit(tokens[:data.draw(st.integers(1, len(tokens)))] + tail)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        tokens, table, registered = self.seqs[i]
        if len(tokens) % BLOCK == 0:
            if self.pool.num_free_blocks == 0:
                return
            table.append(self.pool.allocate())
        tokens.append(token)
        self.seqs[i] = (tokens, table, self.cache.register(tokens, table, len(tokens), registered))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        _, table, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.pool.release_all(table)

    @precondition(lambda self: self.pool.num_free_blocks > 0)
    @rule()
    def evict(self):
        """Take a free block (evicting whatever it cached) and give it back."""
        b = self.pool.allocate()
        assert self.pool.blocks[b].block_hash is None
        self.pool.release(b)

    @invariant()
    def refcounts_match_tables(self):
        held = Counter(b for _, table, _ in self.seqs for b in table)
        for block in self.pool.blocks:
            assert block.ref_count == held[block.block_id]
            assert (block.block_id in self.pool.free) == (held[block.block_id] == 0)
        assert self.pool.num_free_blocks == len(self.pool.blocks) - len(held)

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        for tokens, table, registered in self.seqs:
            hashes = block_hashes(tokens, BLOCK, registered)
            for i in range(registered):
                block = self.pool.blocks[table[i]]
                assert block.token_ids == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
                assert block.block_hash == hashes[i]

    @invariant()
    def matches_are_true_prefixes(self):
        for tokens, _, _ in self.seqs:
            hits = self.cache.match(tokens)
            assert len(hits) * BLOCK <= len(tokens) - 1
            for i, b in enumerate(hits):
                assert self.pool.blocks[b].token_ids == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 40), num_decodes=st.integers(0, 50),
       remaining=st.lists(st.integers(1, 60), max_size=8), cap=st.integers(1, 30))
def test_split_budget_against_brute_force(budget, num_decodes, remaining, cap):
    decodes, chunks = split_budget(budget, num_decodes, remaining, cap)
    # Brute force: hand out the budget one token at a time - decodes first, then prompts in order,
    # each prompt up to min(remaining, cap).
    left, want = budget, min(num_decodes, budget)
    left -= want
    expected = []
    for r in remaining:
        take = 0
        while left > 0 and take < min(r, cap):
            take += 1
            left -= 1
        expected.append(take)
    assert (decodes, chunks) == (want, expected)
    assert decodes + sum(chunks) <= budget


def fake_model_step(scheduler: Scheduler, batch) -> None:
    """One step of a fake model: account the batch's tokens, "sample" token 1 for every sequence at the end of
    its known tokens, finish and remove the requests that stop; then check the scheduler's invariants. Requests
    that finished earlier in a multi-step burst are skipped, as the engine does."""
    for request, n in batch.items:
        if not request.is_finished:
            scheduler.update_after_step(request, n)
    for request, n in batch.items:
        if not request.is_finished and request.num_computed_tokens == len(request.token_ids):
            request.append_token(1, 0.0)
            if request.finish_reason is not None:
                scheduler.remove(request)
                request.finish(request.finish_reason)
    scheduler.check_invariants()


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
       budget=st.integers(1, 24), cap=st.integers(1, 10), seats=st.integers(1, 6), block_size=st.integers(1, 5),
       num_blocks=st.integers(30, 60), arrivals=st.lists(st.integers(0, 5), min_size=12, max_size=12))
def test_random_schedules_keep_the_rules(prompts, budget, cap, seats, block_size, num_blocks, arrivals):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=seats,
                          max_num_batched_tokens=budget, max_prefill_chunk=cap)
    prompts = [(n, m) for n, m in prompts if -(-(n + m) // block_size) <= num_blocks]
    pool = BlockPool(num_blocks)
    scheduler = Scheduler(config, pool, PrefixCache(pool, block_size))
    requests = [Request(f"r{i}", None, [i % 7] * n, SamplingParams(max_new_tokens=m), frozenset())
                for i, (n, m) in enumerate(prompts)]
    pending = list(requests)
    step = 0
    while pending or scheduler.has_work():
        arriving = arrivals[step % len(arrivals)] if scheduler.has_work() else max(1, arrivals[step % len(arrivals)])
        for _ in range(min(arriving, len(pending))):
            scheduler.add(pending.pop(0))
        batch = scheduler.schedule()
        step += 1
        assert step < 5000, "no progress"
        # the rules, checked on the batch itself
        assert batch.num_tokens <= budget
        ids = [r.request_id for r, _ in batch.items]
        assert len(ids) == len(set(ids))
        decodes, prefills = batch.items[:batch.num_decodes], batch.items[batch.num_decodes:]
        assert all(n == 1 and r in scheduler.running_requests for r, n in decodes)
        # decodes first: every running request decodes unless the budget ran out
        assert batch.num_decodes == min(len(scheduler.running_requests), budget)
        for request, n in prefills:
            full = min(cap, request.num_prefill_tokens - request.num_computed_tokens)
            assert request in scheduler.prefilling_requests and 1 <= n <= full
            if n < full:                      # a short chunk only when the budget is spent
                assert batch.num_tokens == budget
        assert len(scheduler.prefilling_requests) + len(scheduler.running_requests) <= seats
        fake_model_step(scheduler, batch)
    assert all(r.is_finished and r.num_output_tokens == r.params.max_new_tokens for r in requests)
    assert pool.num_free_blocks == num_blocks


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=10),
       budget=st.integers(1, 24), seats=st.integers(1, 6), block_size=st.integers(1, 5),
       num_blocks=st.integers(20, 50), max_steps=st.integers(1, 9),
       arrivals=st.lists(st.integers(0, 4), min_size=8, max_size=8), at_limit=st.booleans())
@example(prompts=[(20, 3), (1, 12)], budget=8, seats=2, block_size=4, num_blocks=30, max_steps=8,
         arrivals=[2, 0, 0, 0, 0, 0, 0, 0], at_limit=True)          # the first request caps the bursts at its end
def test_multi_step_bursts_keep_the_rules(prompts, budget, seats, block_size, num_blocks, max_steps, arrivals,
                                          at_limit):
    """`minirt.fast.multi_step.BurstScheduler.decode_steps_ahead` against its rules, under random arrivals and a
    fake model that takes every burst's steps one by one: a burst only when all admitted requests decode and none waits, as long as `max_steps`
    or the most tokens any request has left (requests with fewer end part-way, their later tokens dropped) but no
    request past `max_model_len` (at_limit: the longest request's prompt + max_new_tokens; else None, no limit), and
    with every new token's slot allocated."""
    prompts = [(n, m) for n, m in prompts if -(-(n + m) // block_size) <= num_blocks]
    limit = max((n + m for n, m in prompts), default=None) if at_limit else None
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=seats,
                          max_num_batched_tokens=budget, max_prefill_chunk=8, max_model_len=limit)
    pool = BlockPool(num_blocks)
    scheduler = BurstScheduler(config, pool, PrefixCache(pool, block_size), max_steps)
    requests = [Request(f"r{i}", None, [i % 5] * n, SamplingParams(max_new_tokens=m), frozenset())
                for i, (n, m) in enumerate(prompts)]
    pending = list(requests)
    step, bursts = 0, 0
    while pending or scheduler.has_work():
        arriving = arrivals[step % len(arrivals)] if scheduler.has_work() else max(1, arrivals[step % len(arrivals)])
        for _ in range(min(arriving, len(pending))):
            scheduler.add(pending.pop(0))
        running = list(scheduler.running_requests)
        all_decode = (not scheduler.waiting_queue and not scheduler.prefilling_requests and running
                      and len(running) <= budget)
        left = max((r.params.max_new_tokens - r.num_output_tokens for r in running), default=0)
        if limit is not None:                           # the positions the request with the fewest has left
            left = min([left] + [limit - r.num_computed_tokens for r in running])
        free_before = pool.num_free_blocks
        k = scheduler.decode_steps_ahead()
        if k > 1:
            bursts += 1
            assert all_decode and k == min(max_steps, left)
            for r in running:
                assert len(r.block_table) * block_size >= r.num_computed_tokens + k
        else:
            assert pool.num_free_blocks == free_before       # no burst: nothing allocated
            fits = sum(max(0, -(-(r.num_computed_tokens + min(max_steps, left)) // block_size) - len(r.block_table))
                       for r in running) <= free_before
            assert not (all_decode and min(max_steps, left) >= 2 and fits)
        batch = scheduler.schedule()
        step += 1
        assert step < 5000, "no progress"
        if k > 1:
            assert [r for r, _ in batch.items] == running and all(n == 1 for _, n in batch.items)
        for _ in range(k):
            fake_model_step(scheduler, batch)
    assert all(r.is_finished and r.num_output_tokens == r.params.max_new_tokens for r in requests)
    assert pool.num_free_blocks == num_blocks
