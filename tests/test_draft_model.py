"""The shipped draft checkpoint and the "draft" drafter (`minirt.spec.draft_model.DraftModelProposer`).

Oracles: `transformers` on the same checkpoint (its logits, its greedy `generate`), a fresh proposer (drafts
after any rollback or catch-up equal drafts from scratch), `minirt.sampling.probs_after_filters` on the
oracle's logits (the distributions the drafts are drawn from) and a chi-square test (that they ARE drawn).
"""

import json
from pathlib import Path

import pytest
import torch

import minirt
from minirt.request import Request
from minirt.sampling import SamplingParams, probs_after_filters
from minirt.spec import DRAFT_MODEL, DraftModelProposer
from tests.conftest import hf_greedy, hf_logits

PROMPTS = ["ROMEO:\n", "JULIET.\nO Romeo, Romeo! wherefore art thou", "Of Mans First Disobedience, and the",
           "KING LEAR.\nHow now, my lord? What's the matter?\n\nGLOUCESTER.\n"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DRAFT_MODEL)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def proposer() -> DraftModelProposer:
    return DraftModelProposer(device="cpu", dtype=torch.float32)


def make_request(ids, i=0, **params) -> Request:
    return Request(f"r{i}", None, list(ids), SamplingParams(**params), frozenset({0}))


def test_draft_checkpoint_ships_beside_the_default_model():
    path = Path(DRAFT_MODEL)
    assert path.is_absolute() and Path(minirt.__file__).parent == path.parent
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert size < 4_000_000, f"{path} is {size} bytes"
    default = Path(minirt.DEFAULT_MODEL)
    # the same tokenizer: the drafts are the target's token ids
    assert (path / "tokenizer.json").read_bytes() == (default / "tokenizer.json").read_bytes()
    draft_cfg, target_cfg = (json.loads((p / "config.json").read_text()) for p in (path, default))
    assert draft_cfg["vocab_size"] == target_cfg["vocab_size"]
    assert draft_cfg["num_hidden_layers"] < target_cfg["num_hidden_layers"]
    report = json.loads((path / "training_report.json").read_text())
    assert report["heldout_test_loss"] < report["unigram_baseline_loss"]
    assert report["target"]["greedy_agreement_test"] > 0.5


def test_draft_logits_equal_transformers(proposer, prompt_ids):
    """minirt's `DecoderModel` and transformers' Qwen3 on the draft checkpoint, float32, full sequences."""
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            ours = proposer.model.compute_logits(proposer.model(x, torch.arange(len(ids))[None]))
        torch.testing.assert_close(ours, hf_logits(DRAFT_MODEL, x), rtol=1e-4, atol=1e-4)


def test_greedy_drafts_equal_transformers_generate(proposer, prompt_ids):
    """A batch of requests of different lengths and different k: each draft is the draft model's own greedy
    continuation."""
    ks = [6, 1, 4, 8]
    requests = [make_request(ids, i) for i, ids in enumerate(prompt_ids)]
    drafts = proposer.propose(requests, ks)
    for ids, k, draft in zip(prompt_ids, ks, drafts):
        assert draft == hf_greedy(DRAFT_MODEL, ids, k)
    assert all(proposer.draft_probs(r) is None for r in requests)       # greedy: no distributions
    for r in requests:
        proposer.remove(r)
    assert proposer.num_used_blocks == 0 and not proposer.states


@pytest.mark.parametrize("num_accepted", [0, 2, 5])
def test_rollback_and_catch_up_equal_drafts_from_scratch(prompt_ids, num_accepted):
    """Propose 5, the target keeps `num_accepted` of them and adds its own token, rollback; the next drafts
    equal those of a fresh proposer (and of transformers) on the same tokens. block_size 4 and a pool of one
    block: blocks are released and the pool grows along the way."""
    cfg = type("Config", (), {"block_size": 4, "speculative_model": None})()
    spec = DraftModelProposer(cfg, device="cpu", dtype=torch.float32, num_blocks=1)
    requests = [make_request(ids, i) for i, ids in enumerate(prompt_ids[:2])]
    first = spec.propose(requests, [5, 5])
    for request, draft in zip(requests, first):
        bonus = 7 if draft[num_accepted:num_accepted + 1] != [7] else 8        # never the next draft token
        request.token_ids += draft[:num_accepted] + [bonus]
        spec.rollback(request, len(request.token_ids) - 1)
        state = spec.states[request]
        assert state.num_computed_tokens <= len(request.token_ids) - 1
        assert len(state.block_table) == -(-state.num_computed_tokens // 4)
    again = spec.propose(requests, [5, 5])
    fresh = DraftModelProposer(cfg, device="cpu", dtype=torch.float32)
    assert again == fresh.propose([make_request(r.token_ids, 9 + i) for i, r in enumerate(requests)], [5, 5])
    assert again == [hf_greedy(DRAFT_MODEL, r.token_ids, 5) for r in requests]


def test_catch_up_without_rollback(proposer, prompt_ids):
    """No rollback call at all (a step whose drafts were dropped, a preempted request that kept its state):
    `propose` finds the prefix its cache agrees with from `request.token_ids` alone."""
    request = make_request(prompt_ids[2])
    proposer.propose([request], [4])
    proposer.propose([request], [4])                          # the same tokens again: nothing was kept
    request.token_ids[-2:] = [11, 12]                         # an edit inside what the cache has seen
    assert proposer.propose([request], [3]) == [hf_greedy(DRAFT_MODEL, request.token_ids, 3)]
    proposer.remove(request)
    assert proposer.num_used_blocks == 0


def test_sampled_drafts_report_the_filtered_distributions(proposer, prompt_ids):
    """Each row of `draft_probs` is `probs_after_filters` of the draft model's logits at that position (the
    target's filters), the drafts lie in its support, and a seeded request drafts reproducibly."""
    settings = [dict(temperature=0.8, top_k=40, seed=1), dict(temperature=1.3, top_p=0.9, seed=2),
                dict(temperature=0.7, top_k=5, top_p=0.5, seed=3)]
    requests = [make_request(prompt_ids[i], i, **s) for i, s in enumerate(settings)]
    drafts = proposer.propose(requests, [5, 5, 5])
    for request, draft, s in zip(requests, drafts, settings):
        q = proposer.draft_probs(request)
        assert q.shape == (5, proposer.vocab_size)
        ids = request.token_ids + draft
        logits = hf_logits(DRAFT_MODEL, torch.tensor([ids]))[0, len(request.token_ids) - 1:-1]
        want = torch.stack([probs_after_filters(row, s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0))
                            for row in logits])
        torch.testing.assert_close(q, want, rtol=1e-4, atol=1e-5)
        assert all(q[i, t] > 0 for i, t in enumerate(draft))
    again = DraftModelProposer(device="cpu", dtype=torch.float32)
    assert again.propose([make_request(r.token_ids, i, **s) for i, (r, s) in enumerate(zip(requests, settings))],
                         [5, 5, 5]) == drafts
    for r in requests:
        proposer.remove(r)
    assert proposer.num_used_blocks == 0 and not proposer.states


def test_sampled_drafts_are_drawn_from_their_distribution(proposer, prompt_ids):
    """400 unseeded requests on one prompt, one draft each: the drafts' frequencies match q (chi-square), so
    the drafter samples rather than takes the argmax."""
    n, top_k = 400, 4
    requests = [make_request(prompt_ids[0], i, temperature=1.0, top_k=top_k) for i in range(n)]
    torch.manual_seed(0)
    drafts = proposer.propose(requests, [1] * n)
    q = proposer.draft_probs(requests[0])[0]
    support = q.nonzero().flatten().tolist()
    assert len(support) == top_k
    counts = torch.tensor([sum(d == [t] for d in drafts) for t in support], dtype=torch.float64)
    assert counts.sum() == n
    expected = q[support].double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27, (counts.tolist(), expected.tolist())      # p = 0.001 at 3 degrees of freedom
    assert counts.min() > 0 and max(counts) < n                  # not the argmax every time
    for r in requests:
        proposer.remove(r)
    assert proposer.num_used_blocks == 0


def test_speculative_engine_with_the_draft_model_frees_everything(default_model):
    """`LLM(speculative="draft")` end to end: greedy output equals the plain engine's, and the drafter holds
    no state and no block once the requests are done."""
    prompts = PROMPTS[:3]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = minirt.LLM(model=default_model, dtype="float32", device="cpu")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = minirt.LLM(model=default_model, dtype="float32", device="cpu", speculative="draft",
                     num_speculative_tokens=4)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    steps = llm.engine.speculation
    assert isinstance(steps.proposer, DraftModelProposer)
    assert steps.num_draft_tokens > 0 and steps.num_accepted_tokens > 0
    assert not steps.proposer.states and steps.proposer.num_used_blocks == 0
