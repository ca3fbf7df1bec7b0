"""Chapter 11: the "draft" drafter - a small model of the target's tokenizer proposes the next k tokens.

`DraftModelProposer` runs the shipped draft checkpoint (`DRAFT_MODEL`, `minirt/draft_model/`: one Qwen3 layer
of width 256, distilled from the default model) through minirt's own pieces: the model is chapter 01's
`DecoderModel`, its K/V live in a paged cache of its own (chapter 03's `BlockPool` and KV tensor), and each
forward is chapter 05's `ModelRunner` over a packed batch. A step drafts for all the requests at once:

1. **catch up**: each request's draft cache holds K/V for a prefix of the tokens it has seen. Whatever of
   `request.token_ids` is past the longest prefix the cache agrees with (the whole prompt for a new request,
   the target's bonus token after a verification, everything after a preemption) is fed in one forward, the
   requests packed together as prefill rows; the last row of each gives the distribution of draft token 1.
2. **draft**: k - 1 more forwards of one row per request, each feeding the token just drafted. A greedy request
   takes the argmax; a sampled one draws from the draft's distribution after the request's temperature, top-k
   and top-p (the target's filters, `minirt.sampling.filter_logits`) and keeps those distributions
   (`draft_probs`): rejection sampling is exact only when the draft tokens are drawn from the q it is given.
   The draws use a generator of the drafter's own per seeded request (its seed mixed, so it never repeats the
   stream of the request's generator, whose draws belong to the acceptance test).
3. **roll back**: after the target's verdict (`rollback`), K/V of tokens past the final ones are dropped and
   whole blocks past them go back to the pool (`minirt.spec.rollback_block_table`); `remove` frees a request
   that finished, was aborted or preempted.

The drafter's cache holds the prompt, the kept tokens and k - 1 drafts per request: the last draft token is
never fed (its K/V would only be needed for a draft k + 1). The pool grows (doubling its KV tensor) when a
step needs more blocks than it has, so no size has to be guessed: a 1-layer draft costs 1/6 of the target's
K/V per token. vLLM's draft-model proposer shares the target's block tables instead; a cache of its own keeps
the two models independent here (any block size, any target engine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from minirt.kv.block_pool import Block, BlockPool
from minirt.kv.paged_cache import allocate_kv_cache
from minirt.model.loader import load_model
from minirt.model_runner import ModelRunner
from minirt.request import Request
from minirt.sampling import filter_logits
from minirt.spec.proposer import Proposer
from minirt.spec.rollback import rollback_block_table

#: The shipped draft checkpoint, the default `speculative_model` (same tokenizer as `minirt.DEFAULT_MODEL`).
DRAFT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "draft_model")

#: Mixed into a seeded request's seed for the drafter's own generator (a 64-bit odd constant: SplitMix64's).
SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class DraftState:
    """One request's draft cache: `token_ids[:num_computed_tokens]` have K/V in `block_table`'s blocks.

    Has the three fields chapter 05's `ModelRunner.prepare_lists` reads from a request, so the runner
    packs it as it packs a request: `token_ids[num_computed_tokens:]` are the rows of the next forward."""
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    probs: torch.Tensor | None = None                   # [len(last draft), V]: what it was drawn from


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (one slice comparison when one extends the other)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    """The "draft" drafter (module docstring): `propose`, `draft_probs`, `rollback`, `remove` of
    `minirt.spec.proposer.Proposer`.

    config: the engine's `EngineConfig` (or None for the defaults): `speculative_model` (None: `DRAFT_MODEL`)
    and `block_size` are read from it. device, dtype: where and in what the draft runs (the target's; None:
    the loader's defaults). vocab_size: the target's vocabulary, checked against the draft's when given.
    num_blocks: the pool's first size (it grows on demand).
    """

    def __init__(self, config=None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 vocab_size: int | None = None, num_blocks: int = 64):
        path = getattr(config, "speculative_model", None) or DRAFT_MODEL
        self.model, _ = load_model(path, device=device, dtype=dtype)
        self.device, self.dtype = self.model.device, self.model.dtype
        self.vocab_size = self.model.config.vocab_size
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"speculative_model: {str(path)!r} has {self.vocab_size} tokens, the target "
                             f"{vocab_size}: a draft model needs the target's tokenizer")
        self.block_size = getattr(config, "block_size", None) or 16
        self.pool = BlockPool(num_blocks)
        kv = allocate_kv_cache(self.model.config, num_blocks, self.block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv, self.block_size)
        self.states: dict[Request, DraftState] = {}

    # ------------------------------------------------------------------ the Proposer interface

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to `num_tokens[i]` draft tokens for each of `requests`, continuing `request.token_ids`
        (module docstring, steps 1-2): `1 + max(num_tokens) - 1` forwards of the draft model in all."""
        states = [self._catch_up(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        while active:
            logits = self._forward([states[i] for i in active])            # [len(active), V]
            picks, rows = self._pick(logits, [requests[i] for i in active], [states[i] for i in active])
            for j, i in enumerate(active):
                drafts[i].append(picks[j])
                if rows is not None and rows[j] is not None:
                    probs[i].append(rows[j])
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            for i in active:                                               # the next forward feeds this draft
                states[i].token_ids.append(drafts[i][-1])
        for state, p in zip(states, probs):
            state.probs = torch.stack(p) if p else None
        return drafts

    def draft_probs(self, request: Request) -> torch.Tensor | None:
        """`[len(draft), V]`: the distributions `request`'s last draft was drawn from; None for a greedy one."""
        state = self.states.get(request)
        return None if state is None else state.probs

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Only `request.token_ids[:num_tokens]` are final: forget K/V past them, release blocks past them."""
        state = self.states.get(request)
        if state is not None:
            self._crop(state, num_tokens)

    def remove(self, request: Request) -> None:
        """Free everything `request` holds (finished, aborted or preempted; it may come back later)."""
        state = self.states.pop(request, None)
        if state is not None:
            self.pool.release_all(state.block_table)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    # ------------------------------------------------------------------ the pieces

    def _catch_up(self, request: Request) -> DraftState:
        """The request's state, its cache cut to the longest prefix that agrees with `request.token_ids` (and
        short of the last token, which the next forward must feed), `token_ids` set to the request's."""
        state = self.states.get(request)
        if state is None:
            state = self.states[request] = DraftState(generator=self._generator(request))
        keep = common_prefix_len(state.token_ids[:state.num_computed_tokens], request.token_ids)
        self._crop(state, min(keep, len(request.token_ids) - 1))
        state.token_ids = list(request.token_ids)
        return state

    def _crop(self, state: DraftState, num_tokens: int) -> None:
        n = min(state.num_computed_tokens, num_tokens)
        state.num_computed_tokens = n
        del state.token_ids[n:]
        rollback_block_table(state.block_table, self.pool, n, self.block_size)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None or request.params.greedy:
            return None
        return torch.Generator(device=self.device).manual_seed((seed ^ SEED_MIX) % 2**63)

    def _forward(self, states: list[DraftState]) -> torch.Tensor:
        """Feed each state's uncomputed tokens (packed, chapter 05's runner); float32 logits `[len(states), V]`
        of each one's last row. Marks the tokens computed."""
        B = self.block_size
        for state in states:
            need = -(-len(state.token_ids) // B) - len(state.block_table)
            state.block_table += [self._allocate() for _ in range(need)]
        step = self.runner.prepare_lists([(s, len(s.token_ids) - s.num_computed_tokens) for s in states])
        hidden = self.runner.forward(step)                                  # one row per state: each ends
        for state in states:
            state.num_computed_tokens = len(state.token_ids)
        return self.model.compute_logits(hidden)

    def _allocate(self) -> int:
        """A block from the pool, doubling the pool and its KV tensor first if none is free."""
        if self.pool.num_free_blocks == 0:
            old = self.pool.num_blocks
            for block_id in range(old, 2 * old):
                self.pool.blocks.append(Block(block_id))
                self.pool.free[block_id] = None
            self.runner.kv_cache = torch.cat([self.runner.kv_cache, torch.zeros_like(self.runner.kv_cache)], dim=2)
        return self.pool.allocate()

    def _pick(self, logits: torch.Tensor, requests: list[Request], states: list[DraftState]):
        """The next draft token of each row, and (for sampled rows) the distribution it was drawn from:
        `(tokens: list[int], probs: list[Tensor [V] | None] | None)`."""
        tokens = logits.argmax(dim=-1)
        sampled = [j for j, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return tokens.tolist(), None
        dev = logits.device
        params = [requests[j].params for j in sampled]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        q = filter_logits(logits[sampled] / temperature[:, None], top_k, top_p).softmax(dim=-1)
        rows: list[torch.Tensor | None] = [None] * len(requests)
        for at, j in enumerate(sampled):
            tokens[j] = torch.multinomial(q[at], 1, generator=states[j].generator)[0]
            rows[j] = q[at]
        return tokens.tolist(), rows
