"""Speculative decoding's pure pieces against independent oracles: greedy acceptance against decoding one token at a
time; rejection sampling's output distribution against the target's own (chi-square over thousands of seeded
draws: the first token against p_0, the number of accepted drafts against sum(min(p, q)), whole sequences of a
context-dependent target against its autoregressive law); the n-gram proposer against a search over every
occurrence; the block-table rollback against the block pool's reference counts."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minirt.course.checks import chi_square_pvalue, speculative_outcome_probs
from minirt.kv import BlockPool, PrefixCache
from minirt.sampling import probs_after_filters
from minirt.spec import greedy_accept, propose_ngram, rejection_sample, rollback_block_table

PVALUE = 1e-5      # seeded draws: each test is deterministic; an exact sampler fails it about once in 1e5 seeds


def _probs(seed: int, rows: int, V: int, zero=()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, V, generator=g) + 0.1
    for r, t in zero:
        w[r, t] = 0.0
    return w / w.sum(-1, keepdim=True)


def _onehot(tokens, V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), V).float()


# ------------------------------------------------------------------------------------------- the statistics


def test_chi_square_pvalue_against_closed_forms():
    """Oracle: the chi-square tails with closed forms, df = 2: exp(-x/2); df = 1: erfc(sqrt(x/2))."""
    obs, prob = [60, 40, 100], [0.25, 0.25, 0.5]            # statistic (10^2 + 10^2) / 50 + 0 = 4
    assert chi_square_pvalue(obs, prob) == pytest.approx(math.exp(-2.0), rel=1e-9)
    assert chi_square_pvalue([55, 45], [0.5, 0.5]) == pytest.approx(math.erfc(math.sqrt(0.5)), rel=1e-9)
    assert chi_square_pvalue([50, 50], [0.5, 0.5]) == pytest.approx(1.0)
    assert chi_square_pvalue([99, 1], [1.0, 0.0]) == 0.0              # a draw where the law puts nothing
    assert chi_square_pvalue([98, 1, 1], [0.98, 0.01, 0.01]) == 1.0  # expected 1, 1: pooled, one cell left


def test_outcome_probs_against_enumerating_every_draft():
    """Oracle: enumerate every draft x in V^k with its probability prod q_i(x_i), follow the rule's branches
    (accept with min(1, p/q), else the normalized residual) in float64, and add up P(accepted j, last token y)."""
    k, V = 2, 3
    p, q = _probs(1, k + 1, V, zero=[(0, 2)]).double(), _probs(2, k, V, zero=[(1, 0)]).double()
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)          # exact sums of 1 in float64
    want = torch.zeros(k + 1, V, dtype=torch.float64)
    for x in itertools.product(range(V), repeat=k):
        reach = math.prod(float(q[i, x[i]]) for i in range(k))
        for j in range(k + 1):
            if j == k:
                want[k] += reach * p[k]
                break
            accept = min(1.0, float(p[j, x[j]] / q[j, x[j]])) if q[j, x[j]] > 0 else 1.0
            residual = (p[j] - q[j]).clamp(min=0)
            if residual.sum() > 0:
                want[j] += reach * (1 - accept) * residual / residual.sum()
            reach *= accept
    torch.testing.assert_close(speculative_outcome_probs(q, p), want, rtol=1e-12, atol=1e-12)
    assert float(want.sum()) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------- greedy


def _one_token_at_a_time(draft, target):
    """Oracle: what decoding one token at a time emits before its output leaves the draft."""
    out = []
    for i, t in enumerate(target):
        out.append(t)
        if i == len(draft) or t != draft[i]:
            return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8).flatmap(lambda k: st.tuples(st.lists(st.integers(0, 3), min_size=k, max_size=k),
                                                     st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1))))
def test_greedy_accept_equals_one_token_at_a_time(pair):
    draft, target = pair
    assert greedy_accept(draft, target) == _one_token_at_a_time(draft, target)
    assert greedy_accept(torch.tensor(draft, dtype=torch.long), torch.tensor(target)) == greedy_accept(draft, target)


def test_greedy_accept_refuses_a_target_of_the_wrong_length():
    with pytest.raises(ValueError, match="target_argmax"):
        greedy_accept([1, 2], [1, 2])


def test_one_hot_targets_make_rejection_sampling_greedy():
    """A greedy request's p is one-hot (probs_after_filters at temperature 0): the rule accepts exactly the
    drafts equal to the argmax, whatever the draws."""
    g = torch.Generator().manual_seed(0)
    for seed in range(200):
        rng = torch.Generator().manual_seed(seed)
        k = int(torch.randint(0, 6, (1,), generator=rng))
        logits = torch.randn(k + 1, 4, generator=rng)
        p = torch.stack([probs_after_filters(row, 0.0, 0, 1.0) for row in logits])
        draft = torch.randint(0, 4, (k,), generator=rng).tolist()
        draft[: k // 2] = logits.argmax(-1)[: k // 2].tolist()             # some accepted prefixes
        assert rejection_sample(draft, None, p, g) == greedy_accept(draft, logits.argmax(-1))


# ------------------------------------------------------------------------------------------- rejection sampling


def _run(draft_of, q, p, draws, seed):
    """Counts of (accepted j, last token y) and of the first token over `draws` seeded generators."""
    k, V = p.shape[0] - 1, p.shape[1]
    joint, first = torch.zeros(k + 1, V), torch.zeros(V)
    drafts = torch.Generator().manual_seed(seed)
    for s in range(draws):
        draft = draft_of(drafts)
        out = rejection_sample(draft, q, p, torch.Generator().manual_seed(seed * 7919 + s))
        joint[len(out) - 1, out[-1]] += 1
        first[out[0]] += 1
    return joint, first


CASES = {   # name: (p [k+1, V], q [k, V] or None, fixed draft or None)
    "drafter with q (k=2, V=4)": (_probs(3, 3, 4), _probs(4, 2, 4), None),
    "q where p is 0, p where q is 0 (k=2, V=5)": (_probs(5, 3, 5, zero=[(0, 1), (1, 3)]),
                                                 _probs(6, 2, 5, zero=[(0, 2), (1, 0)]), None),
    "deterministic drafter (k=3, V=4)": (_probs(7, 4, 4), None, [1, 3, 0]),
    "deterministic drafter, p(x_0) = 0 (k=2, V=4)": (_probs(8, 3, 4, zero=[(0, 2)]), None, [2, 1]),
    "k = 0 (V=6)": (_probs(9, 1, 6), None, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rejection_sample_emits_the_target_distribution(name):
    """Oracles: the first emitted token ~ p_0 (Leviathan et al. 2023, Theorem 1: exactly the target's law); the
    number of accepted drafts ~ P(j) = beta_0 ... beta_{j-1} (1 - beta_j), beta_i = sum(min(p_i, q_i)) (their
    section 3.3), computed here from the probabilities, not from the sampler."""
    p, q, fixed = CASES[name]
    k, V = p.shape[0] - 1, p.shape[1]
    if q is None:
        draft_of = lambda g: list(fixed)                                       # noqa: E731
        q_rows = _onehot(fixed, V) if k else torch.zeros(0, V)
    else:
        draft_of = lambda g: [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]  # noqa: E731
        q_rows = q
    draws = 4000
    joint, first = _run(draft_of, q, p, draws, seed=len(name))
    assert chi_square_pvalue(first, p[0]) > PVALUE
    beta = [float(torch.minimum(p[i], q_rows[i]).sum()) for i in range(k)]
    accepted = [math.prod(beta[:j]) * (1 - beta[j]) for j in range(k)] + [math.prod(beta)]
    assert chi_square_pvalue(joint.sum(1), accepted) > PVALUE
    assert chi_square_pvalue(joint, speculative_outcome_probs(q_rows, p)) > PVALUE


def _table(seed: int, V: int, temperature: float = 1.0):
    """A context-dependent distribution over V tokens: a seeded lookup on the whole prefix."""
    @functools.lru_cache(maxsize=None)
    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(prefix) % 1_000_000)
        w = (torch.rand(V, generator=g) + 0.05) ** (1 / temperature)
        return w / w.sum()
    return dist


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_whole_sequences_follow_the_target_model(drafter):
    """Oracle: the target's autoregressive law P(y_0 y_1 y_2) = p(y_0) p(y_1 | y_0) p(y_2 | y_0 y_1), against
    sequences built by speculative steps (k = 2, a drafter whose q depends on the prefix too, or its argmax as a
    deterministic drafter), repeated until 3 tokens, over all 27 sequences of V = 3."""
    V, L, k, draws = 3, 3, 2, 4000
    target, drafter_q = _table(1, V), _table(2, V, temperature=0.5)
    counts = {}
    drafts = torch.Generator().manual_seed(5)
    for s in range(draws):
        seq, g = (), torch.Generator().manual_seed(100_000 + s)
        while len(seq) < L:
            draft, qs = [], []
            for _ in range(k):
                q = drafter_q(seq + tuple(draft))
                x = int(torch.multinomial(q, 1, generator=drafts)) if drafter == "sampled" else int(q.argmax())
                draft.append(x)
                qs.append(q)
            p = torch.stack([target(seq + tuple(draft[:i])) for i in range(k + 1)])
            seq += tuple(rejection_sample(draft, torch.stack(qs) if drafter == "sampled" else None, p, g))
        counts[seq[:L]] = counts.get(seq[:L], 0) + 1
    cells = list(itertools.product(range(V), repeat=L))
    law = [math.prod(float(target(y[:i])[y[i]]) for i in range(L)) for y in cells]
    assert sum(law) == pytest.approx(1.0, abs=1e-6)
    assert chi_square_pvalue([counts.get(y, 0) for y in cells], law) > PVALUE


@st.composite
def _step(draw):
    V, k = draw(st.integers(2, 6)), draw(st.integers(0, 5))
    weights = lambda: draw(st.lists(st.integers(0, 4), min_size=V, max_size=V).filter(any))   # noqa: E731
    p = torch.tensor([weights() for _ in range(k + 1)], dtype=torch.float32)
    deterministic = draw(st.booleans())
    q = None if deterministic else torch.tensor([weights() for _ in range(k)], dtype=torch.float32).reshape(k, V)
    if q is None:
        draft = draw(st.lists(st.integers(0, V - 1), min_size=k, max_size=k))
    else:
        draft = [draw(st.sampled_from([t for t in range(V) if q[i, t] > 0])) for i in range(k)]
        q = q / q.sum(-1, keepdim=True)
    return draft, q, p / p.sum(-1, keepdim=True), draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(_step())
def test_rejection_sample_properties(step):
    """Whatever the distributions (zeros included) and the seed: 1 .. k+1 tokens, the drafts' prefix then one
    token the target allows there; a correction differs from the draft it replaces; seeds are honoured and
    torch's global generator is never touched."""
    draft, q, p, seed = step
    k = len(draft)
    before = torch.get_rng_state()
    out = rejection_sample(draft, q, p, torch.Generator().manual_seed(seed))
    assert torch.equal(torch.get_rng_state(), before)
    assert 1 <= len(out) <= k + 1 and all(type(t) is int for t in out)
    n = len(out) - 1
    assert out[:n] == draft[:n]
    assert p[n, out[-1]] > 0
    if n < k:
        assert out[-1] != draft[n]
        q_x = 1.0 if q is None else float(q[n, draft[n]])
        assert float(p[n, draft[n]]) < q_x                    # only a draft less likely under p is ever rejected
    assert all(float(p[i, draft[i]]) > 0 for i in range(n))   # nothing p forbids is ever accepted
    assert rejection_sample(draft, q, p, torch.Generator().manual_seed(seed)) == out


def test_rejection_sample_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample([1, 2], None, _probs(0, 2, 4), None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample([1, 2], _probs(0, 1, 4), _probs(0, 3, 4), None)


# ------------------------------------------------------------------------------------------- n-gram proposer


def _search_every_occurrence(tokens, k, min_n, max_n):
    """Oracle: every (n, start) whose n-gram equals the last n tokens and ends before the last token; the
    largest n, then the earliest start (vLLM's choice); the up to k tokens after it."""
    found = [(n, s) for n in range(min_n, max_n + 1) for s in range(len(tokens))
             if n < len(tokens) and s + n <= len(tokens) - 1 and tokens[s:s + n] == tokens[len(tokens) - n:]]
    if not found or k == 0:
        return []
    n, s = min(found, key=lambda f: (-f[0], f[1]))
    return tokens[s + n:s + n + k]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=16), st.integers(0, 6), st.integers(1, 3), st.integers(0, 2))
def test_propose_ngram_against_a_search_over_every_occurrence(tokens, k, min_n, extra):
    max_n = min_n + extra
    assert propose_ngram(tokens, k, min_n, max_n) == _search_every_occurrence(tokens, k, min_n, max_n)


@pytest.mark.parametrize("tokens,k,min_n,max_n,want", [
    # the cases of vLLM's tests/v1/spec_decode/test_ngram.py, with the answers vLLM's proposer gives
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 2, 2, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 1, 1, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 3, 2, 2, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 1, 1, [6, 2]),                    # the first occurrence, not the latest
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 4, 4, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 3, 4, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 2, 3, 4, [1, 2]),           # the 4-gram wins over the 3-gram
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 2, 4, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 2, 3, 3, [100, 1]),
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),                          # vLLM's docstring: fewer than k follow
    ([7, 7, 7, 7], 3, 1, 3, [7]),                                      # a match overlapping the suffix
    ([], 3, 1, 3, []), ([5], 3, 1, 3, []), ([1, 2, 1], 0, 1, 3, []),
])
def test_propose_ngram_as_vllm(tokens, k, min_n, max_n, want):
    assert propose_ngram(tokens, k, min_n, max_n) == want


def test_propose_ngram_refuses_bad_lengths():
    for args in ([1], -1, 1, 3), ([1], 2, 0, 3), ([1], 2, 3, 2):
        with pytest.raises(ValueError):
            propose_ngram(*args)


# ------------------------------------------------------------------------------------------- rollback


def _pool_with(num_blocks: int, table: list[int], shared=()) -> BlockPool:
    pool = BlockPool(num_blocks)
    got = [pool.allocate() for _ in range(num_blocks)]
    for b in got:
        if b not in table:
            pool.release(b)
    for b in shared:
        pool.acquire(b)
    return pool


def test_rollback_keeps_the_blocks_of_the_kept_tokens_and_releases_the_rest():
    """Oracle: the pool's counts by hand. 11 tokens of block size 4 fill 3 blocks; keeping 5 keeps 2."""
    pool = _pool_with(8, [6, 2, 5])
    table = [6, 2, 5]
    assert pool.num_free_blocks == 5
    assert rollback_block_table(table, pool, 5, 4) == [5]
    assert table == [6, 2] and pool.num_free_blocks == 6 and pool.blocks[5].ref_count == 0
    assert list(pool.free)[-1] == 5                              # at the end of the free list, as any release
    assert rollback_block_table(table, pool, 8, 4) == [] and table == [6, 2]      # a block boundary: both full
    assert rollback_block_table(table, pool, 4, 4) == [2] and table == [6]
    assert rollback_block_table(table, pool, 0, 4) == [6] and table == [] and pool.num_free_blocks == 8


def test_rollback_releases_shared_blocks_without_freeing_them():
    """A block held by two requests (a prefix-cache hit, ref_count 2) loses one reference and stays out of the free
    list with its hash; the blocks only this request held are freed last block first."""
    B = 4
    pool = _pool_with(6, [3, 1, 4, 0], shared=[3, 1])
    cache = PrefixCache(pool, B)
    table = [3, 1, 4, 0]
    cache.register(list(range(2 * B)), table, 2 * B, 0)            # blocks 3 and 1 hashed (the shared prefix)
    free_before = pool.num_free_blocks
    assert rollback_block_table(table, pool, B + 2, B) == [4, 0]
    assert table == [3, 1]
    assert [pool.blocks[b].ref_count for b in (3, 1, 4, 0)] == [2, 2, 0, 0]
    assert pool.num_free_blocks == free_before + 2 and list(pool.free)[-2:] == [0, 4]
    assert rollback_block_table(table, pool, 0, B) == [3, 1]       # e.g. an abort: the other request keeps them
    assert [pool.blocks[b].ref_count for b in (3, 1)] == [1, 1] and 3 not in pool.free and 1 not in pool.free
    assert sorted(pool.cached.values()) == [1, 3] and cache.match(list(range(2 * B)) + [9]) == [3, 1]


def test_rollback_refuses_bad_arguments():
    pool = _pool_with(2, [0])
    with pytest.raises(ValueError, match="num_tokens"):
        rollback_block_table([0], pool, -1, 4)
    with pytest.raises(ValueError, match="block_size"):
        rollback_block_table([0], pool, 1, 0)
