"""Chapter 11: what the speculative engine asks of a drafter (`Proposer`), and the n-gram drafter behind it.

Each engine step, before scheduling, the engine asks the drafter for up to `num_tokens[i]` draft tokens for each
running request (`propose`); the target then scores them all in one forward (`minirt.spec.engine`). A drafter
that samples its drafts (a draft model with a sampled request) also reports the distributions it drew them from
(`draft_probs`), which rejection sampling needs; a deterministic one (n-gram lookup) reports None. After a
verification the engine says which of the request's tokens are final (`rollback`), and when a request leaves
(finished, aborted or preempted) it says so (`remove`): a drafter with state per request (its own KV cache) drops
what is no longer true. vLLM v1 keeps the same split: its proposers (`NgramProposer`, `EagleProposer`) return
draft token ids, and the scheduler and rejection sampler do the rest.

A drafter may hold stale state or none: a request may run a step without drafts (a large batch, no budget), be
preempted, or have its drafts cut short by the scheduler (budget, free blocks, `max_new_tokens`). `propose` must
catch up from `request.token_ids`, the one truth.
"""

from __future__ import annotations

import torch

from minirt.request import Request
from minirt.spec.ngram import propose_ngram


class Proposer:
    """The drafter interface. Subclasses implement `propose`; the hooks default to doing nothing (a stateless
    drafter). Token ids are Python ints."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Draft tokens for each request: at most `num_tokens[i]` (>= 1) for `requests[i]`, fewer or none allowed
        (the engine then verifies what there is; an empty draft is a plain decode). The drafts continue
        `request.token_ids` (prompt + output so far). A greedy request (`request.params.greedy`) should get the
        drafter's most likely tokens; a sampled one, tokens drawn from the drafter's distribution under the
        request's temperature, top-k and top-p, reported by `draft_probs`. A seeded request's drafts should be
        reproducible, from the drafter's own generator (never `request.generator`, whose draws belong to the
        acceptance test)."""
        raise NotImplementedError

    def draft_probs(self, request: Request) -> torch.Tensor | None:
        """The distributions `[len(draft), vocab_size]` (the target's vocabulary) that `request`'s last draft was
        drawn from, row i the one its token i was drawn from (on any device; the engine moves it); None for a
        deterministic drafter (q one-hot at each draft token) or a greedy request. The engine may verify only a
        prefix of the draft; it reads the first rows."""
        return None

    def rollback(self, request: Request, num_tokens: int) -> None:
        """After a verification: the first `num_tokens` of `request.token_ids` are final; whatever the drafter
        computed for later positions (drafts the target rejected or that were never verified) is not."""

    def remove(self, request: Request) -> None:
        """`request` left the running batch (finished, aborted or preempted): drop its state. It may come back
        (after a preemption) with more tokens than the drafter has seen."""


class NgramProposer(Proposer):
    """Prompt lookup (`minirt.spec.ngram.propose_ngram`): no model, no state, deterministic drafts (draft_probs
    None: rejection sampling takes q one-hot). min_n, max_n: the n-gram lengths tried, longest first."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [propose_ngram(r.token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, num_tokens)]


def build_proposer(engine) -> Proposer:
    """The drafter `engine.plan.speculative` names: "ngram" (`NgramProposer` with the engine's prompt_lookup_min
    and prompt_lookup_max) or "draft" (`minirt.spec.draft_model.DraftModelProposer(engine.config, engine.device,
    engine.model.dtype)`: the draft checkpoint `config.speculative_model`, None for `minirt.spec.DRAFT_MODEL`)."""
    config = engine.config
    if engine.plan.speculative == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if engine.plan.speculative == "draft":
        from minirt.spec.draft_model import DraftModelProposer

        return DraftModelProposer(config, engine.device, engine.model.dtype)
    raise ValueError(f"speculative: no drafter named {engine.plan.speculative!r}")
