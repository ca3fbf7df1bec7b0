"""Speculative decoding in the engine (`minirt.spec.engine`) is exact: greedy output equals transformers' greedy
output token for token, whatever the drafter proposes (n-gram lookup, the true continuation, garbage), the model
family, the block size, chunked prefill, prefix-cache hits and preemption; sampled output is drawn from the
target's own distribution (chi-square against the exact distribution computed from transformers' logits); stops
hold inside an accepted run; blocks never leak; and the plan refuses what does not combine, by name.

Oracles: `transformers`' greedy generate (tests/conftest.py `hf_greedy`), its logits for the exact distribution,
the plain engine's own output where a tokenizer is needed (stop strings), and `Scheduler.check_invariants`.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import minirt
from minirt import SamplingParams
from minirt.config import EngineConfig
from minirt.fast.plan import Hardware, resolve_plan
from minirt.spec.proposer import NgramProposer, Proposer

from conftest import VOCAB, hf_greedy, hf_model

HOPPER = Hardware("cuda", (), (), (), ())


def spec_llm(path, proposer: Proposer | None = None, k: int = 4, **settings) -> minirt.LLM:
    """An LLM with n-gram speculation, its drafter replaced by `proposer` if given, drafting at any batch size."""
    llm = minirt.LLM(path, speculative="ngram", num_speculative_tokens=k, **settings)
    steps = llm.engine.speculation
    steps.max_batch = 10**6
    if proposer is not None:
        steps.proposer = proposer
        llm.engine.scheduler.on_remove = proposer.remove
    return llm


def prompts_for(seed: int, num: int = 6) -> list[list[int]]:
    """Random prompts, half of them repetitive (n-gram lookup finds drafts there)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if i % 2:
            unit = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
            prompts.append((unit * 8)[:rng.randrange(8, 30)])
        else:
            prompts.append([rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))])
    return prompts


class TruthProposer(Proposer):
    """Proposes the true greedy continuation (`truth[prompt]`), each token replaced by a wrong one with
    probability `corrupt`: drafts accepted in full, in part, or not at all. Records which requests it holds
    state for (added at propose, dropped at remove)."""

    def __init__(self, truth: dict, corrupt: float = 0.3, seed: int = 0):
        self.truth, self.corrupt, self.rng = truth, corrupt, random.Random(seed)
        self.live: set[str] = set()
        self.rollbacks = 0

    def propose(self, requests, num_tokens):
        drafts = []
        for request, k in zip(requests, num_tokens):
            self.live.add(request.request_id)
            full = self.truth[tuple(request.prompt_token_ids)]
            n = request.num_output_tokens
            drafts.append([(t + 1) % VOCAB if self.rng.random() < self.corrupt else t for t in full[n:n + k]])
        return drafts

    def rollback(self, request, num_tokens):
        assert num_tokens == len(request.token_ids) - 1
        self.rollbacks += 1

    def remove(self, request):
        self.live.discard(request.request_id)


class GarbageProposer(Proposer):
    def __init__(self, vocab: int = VOCAB, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, requests, num_tokens):
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in num_tokens]


def greedy_truth(path, prompts, n):
    return {tuple(p): hf_greedy(path, p, n) for p in prompts}


# ------------------------------------------------------------------------------------------------ greedy exactness
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_output_equals_transformers_with_every_drafter(tiny_models, family, block_size):
    path, n = tiny_models[family], 24
    prompts = prompts_for(block_size)
    truth = greedy_truth(path, prompts, n)
    expected = [truth[tuple(p)] for p in prompts]
    params = SamplingParams(max_new_tokens=n)
    for proposer in (None, TruthProposer(truth, seed=block_size), GarbageProposer(seed=block_size)):
        llm = spec_llm(path, proposer, k=3 if block_size == 1 else 5, block_size=block_size)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, type(proposer).__name__
        stats = llm.engine.stats()
        assert stats["spec_num_drafts"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        if isinstance(proposer, TruthProposer):      # (what n-gram drafts a random model accepts is its own affair)
            assert stats["spec_num_accepted_tokens"] > 0 and not proposer.live and proposer.rollbacks > 0
        llm.engine.scheduler.check_invariants()


def test_greedy_with_chunked_prefill_and_a_small_token_budget(tiny_models):
    """Prompts in chunks of 5 under a budget of 12 tokens per step: drafts are cut to the budget left after one
    token for every running request, and prefill chunks share the rest."""
    path, n = tiny_models["qwen3"], 20
    prompts = [p * 3 for p in prompts_for(7, 8)]
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.1), k=6, block_size=4, max_prefill_chunk=5,
                   max_num_batched_tokens=12)
    seen = []
    llm.engine.step_callbacks.append(lambda engine, batch: seen.append(batch.num_tokens))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n))
    assert [o.token_ids for o in outs] == [truth[tuple(p)] for p in prompts]
    assert max(seen) <= 12 and llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_greedy_with_prefix_cache_hits(tiny_models):
    """Requests sharing a long prefix, the second wave hitting the blocks the first registered (draft rows never
    registered: a hit on a rejected token's K/V would change the output)."""
    path, n = tiny_models["llama"], 16
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(21)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))] for _ in range(6)]
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.5), k=4, block_size=4)
    for wave in (prompts[:3], prompts):
        outs = llm.generate(wave, SamplingParams(max_new_tokens=n))
        assert [o.token_ids for o in outs] == [truth[tuple(p)] for p in wave]
    assert llm.engine.stats()["prefix_cache_hits"] >= 3 * 20
    # the full output too: second-wave requests equal to first-wave ones hit blocks holding accepted drafts
    for p in prompts[:3]:
        truth[tuple(p + truth[tuple(p)][:12])] = truth[tuple(p)][12:]
    again = llm.generate([p + truth[tuple(p)][:12] for p in prompts[:3]], SamplingParams(max_new_tokens=4))
    assert [o.token_ids for o in again] == [truth[tuple(p)][12:16] for p in prompts[:3]]
    assert any(o.num_cached_tokens >= len(shared) + 8 for o in again)
    llm.engine.scheduler.check_invariants()


def test_greedy_with_preemption_in_a_tiny_pool(tiny_models):
    path, n = tiny_models["qwen2"], 30
    prompts = prompts_for(11, 8)
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.2), k=4, block_size=4, num_kv_blocks=26)
    checks = []
    llm.engine.step_callbacks.append(lambda engine, batch: checks.append(engine.scheduler.check_invariants()))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n))
    assert [o.token_ids for o in outs] == [truth[tuple(p)] for p in prompts]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.engine.speculation.proposer.live


def test_greedy_through_the_fast_runner_and_streamed(tiny_models):
    """Verification steps through chapter 07's runner (`FastModelRunner`: its numpy step builder and staged inputs,
    merged projections on the CPU), and a streamed request whose deltas carry each accepted run."""
    import asyncio

    path, n = tiny_models["qwen3"], 24
    prompts = prompts_for(13, 4)
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.3), k=4, block_size=4, merge_projections=True)
    assert type(llm.engine.model_runner).__name__ == "FastModelRunner"
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n))] == [
        truth[tuple(p)] for p in prompts]

    async def stream():
        engine = minirt.Engine(path, speculative="ngram", block_size=4)
        engine.speculation.proposer = TruthProposer(truth, corrupt=0.3)
        engine.speculation.max_batch = 10**6
        async with engine:
            deltas = [d async for d in engine.stream(prompts[1], SamplingParams(max_new_tokens=n))]
        return deltas, engine.stats()

    deltas, stats = asyncio.run(stream())
    assert [t for d in deltas for t in d.token_ids] == truth[tuple(prompts[1])] and deltas[-1].finished
    assert any(len(d.token_ids) > 1 for d in deltas) and stats["spec_num_accepted_tokens"] > 0


# ------------------------------------------------------------------------------------------------ sampling
SMALL_VOCAB = 6


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> str:
    """A tiny Qwen3 with a vocabulary of 6, its logits spread enough that every token is likely somewhere."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    config = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 0.6)
            elif "norm" not in name:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    model.generation_config = GenerationConfig(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("small_vocab")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@torch.no_grad()
def exact_distribution(path, prompt, n, temperature, top_k) -> dict[tuple, float]:
    """P(first n generated tokens), from transformers' logits: softmax(logits / T) over the top_k tokens."""
    model = hf_model(path)
    probs = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in probs.items():
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1] / temperature
            kth = logits.topk(top_k).values[-1]
            step = logits.masked_fill(logits < kth, float("-inf")).softmax(-1).tolist()
            nxt.update({seq + (t,): p * q for t, q in enumerate(step) if q > 0})
        probs = nxt
    return probs


def chi_square_p(counts: dict, probs: dict, num: int) -> float:
    """The p-value of Pearson's chi-square goodness of fit, cells with an expected count below 5 pooled."""
    big = [c for c in probs if probs[c] * num >= 5]
    observed = [counts.get(c, 0) for c in big] + [num - sum(counts.get(c, 0) for c in big)]
    expected = [probs[c] * num for c in big] + [num * (1 - sum(probs[c] for c in big))]
    if expected[-1] < 5:                       # too small to stand alone: fold it into the smallest cell
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


class SampledDrafter(Proposer):
    """Draws each draft token from a fixed distribution q (its own generator) and reports q: the rejection
    sampler's general case, a drafter whose q differs from the target's p."""

    def __init__(self):
        self.q = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.2, 0.1])
        self.last, self.generators = {}, {}

    def propose(self, requests, num_tokens):
        drafts = []
        for request, k in zip(requests, num_tokens):      # a seeded request's drafts from its own generator
            generator = self.generators.setdefault(request, torch.Generator().manual_seed(request.params.seed))
            drafts.append(torch.multinomial(self.q, k, replacement=True, generator=generator).tolist())
            self.last[request] = self.q.expand(k, SMALL_VOCAB)
        return drafts

    def draft_probs(self, request):
        return self.last[request]

    def remove(self, request):
        self.last.pop(request, None)
        self.generators.pop(request, None)


@pytest.mark.parametrize("drafter", ["ngram", "sampled"])
def test_sampling_draws_from_the_target_distribution(small_vocab_model, drafter):
    path, n, num = small_vocab_model, 3, 3000
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = [SamplingParams(max_new_tokens=n, temperature=0.9, top_k=4, seed=s) for s in range(num)]
    probs = exact_distribution(path, prompt, n, 0.9, 4)
    llm = spec_llm(path, None if drafter == "ngram" else SampledDrafter(), k=3, block_size=4)
    outs = llm.generate([prompt] * num, params)
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > num / 2            # drafts are verified, and some rejected
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert chi_square_p(counts, probs, num) > 1e-3
    # the seeds are honoured: the same seeds again give the same samples
    again = spec_llm(path, None if drafter == "ngram" else SampledDrafter(), k=3, block_size=4)
    assert [o.token_ids for o in again.generate([prompt] * 50, params[:50])] == [o.token_ids for o in outs[:50]]


def test_the_plain_sampler_passes_the_same_test(small_vocab_model):
    """The test's own oracle against the engine without speculation (a test that fails here tests nothing)."""
    path, n, num = small_vocab_model, 3, 3000
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    outs = minirt.LLM(path, block_size=4).generate(
        [prompt] * num, [SamplingParams(max_new_tokens=n, temperature=0.9, top_k=4, seed=s) for s in range(num)])
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    probs = exact_distribution(path, prompt, n, 0.9, 4)
    assert chi_square_p(counts, probs, num) > 1e-3
    wrong = exact_distribution(path, prompt, n, 1.3, 4)         # a nearby wrong distribution is rejected
    assert chi_square_p(counts, wrong, num) < 1e-6


# ------------------------------------------------------------------------------------------------ stops in a run
def test_stop_ids_eos_and_max_tokens_inside_an_accepted_run(tiny_models):
    """Drafts are the exact continuation (all accepted, 8 at a time): the request still ends at the first stop
    id, EOS or its max_new_tokens-th token, and the accepted tokens after it are discarded."""
    path, n = tiny_models["qwen3"], 30
    prompts = prompts_for(5, 4)
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.0), k=8, block_size=4)
    for p in prompts:
        full = truth[tuple(p)]
        stop = full[11]
        cut = full.index(stop) + 1
        out = llm.generate([p], SamplingParams(max_new_tokens=n, stop_token_ids=(stop,)))[0]
        assert out.token_ids == full[:cut] and out.finish_reason == "stop"
        for m in (1, 2, 5, 9, 17):
            out = llm.generate([p], SamplingParams(max_new_tokens=m))[0]
            assert out.token_ids == full[:m] and out.finish_reason == "length"
    llm.engine.eos_token_ids = frozenset({truth[tuple(prompts[0])][6]})
    full = truth[tuple(prompts[0])]
    out = llm.generate([prompts[0]], SamplingParams(max_new_tokens=n))[0]
    assert out.token_ids == full[:full.index(full[6]) + 1] and out.finish_reason == "stop"
    out = llm.generate([prompts[0]], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
    assert out.token_ids == full
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.8 * stats["spec_num_draft_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_stop_strings_inside_an_accepted_run():
    """On the embedded model (it has a tokenizer): the text and tokens equal the plain engine's, stop strings cut
    from the text, whatever the drafts."""
    prompts = ["ROMEO:\nWhat light through yonder window breaks", "To be, or not to be, that is the question"]
    params = SamplingParams(max_new_tokens=24)
    reference = minirt.LLM(minirt.DEFAULT_MODEL)
    plain = reference.generate(prompts, params)
    truth = {tuple(o.prompt_token_ids): o.token_ids for o in plain}
    llm = spec_llm(minirt.DEFAULT_MODEL, TruthProposer(truth, corrupt=0.0), k=8)
    for o in plain:
        stop = o.text[len(o.text) // 3:len(o.text) // 3 + 3]
        want = reference.generate([o.prompt], SamplingParams(max_new_tokens=24, stop=stop))[0]
        got = llm.generate([o.prompt], SamplingParams(max_new_tokens=24, stop=stop))[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert stop not in got.text and want.finish_reason == "stop"
    ngram = spec_llm(minirt.DEFAULT_MODEL, k=4)
    assert [o.token_ids for o in ngram.generate(prompts, params)] == [o.token_ids for o in plain]


# ------------------------------------------------------------------------------------------------ load
def test_no_block_leaked_after_a_load_with_aborts(tiny_models):
    """500 short requests through a small pool (preemptions), one in ten aborted mid-flight, invariants checked
    after every step (and no request holds a block past its tokens: rejected drafts' blocks are released); at the end every block is free, the drafter holds nothing, and each request that finished
    has the plain engine's tokens."""
    path = tiny_models["qwen3"]
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))] * rng.randrange(1, 4) for _ in range(500)]
    lengths = [rng.randrange(1, 10) for _ in prompts]
    plain = minirt.LLM(path).generate(prompts, SamplingParams(max_new_tokens=10))   # (tested against transformers)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    proposer = TruthProposer(truth, corrupt=0.3)
    llm = spec_llm(path, proposer, k=4, block_size=4, num_kv_blocks=40, max_num_seqs=24)
    engine = llm.engine
    requests = [engine._add_request(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts, lengths)]
    doomed = set(rng.sample(range(500), 50))
    steps = 0
    while engine.scheduler.has_work():
        assert engine.step_fn()
        engine.scheduler.check_invariants()
        for r in [*engine.prefilling_requests, *engine.running_requests]:    # rejected drafts' blocks released
            assert len(r.block_table) <= -(-len(r.token_ids) // 4), (r.request_id, r.block_table, len(r.token_ids))
        steps += 1
        for i in [i for i in doomed if requests[i].num_output_tokens and rng.random() < 0.3]:
            engine.abort(requests[i].request_id)
            doomed.discard(i)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not engine.requests and not proposer.live
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    done = [r for r in requests if r.finish_reason == "length"]
    assert len(done) >= 450
    assert all(r.output_token_ids == truth[tuple(r.prompt_token_ids)][:len(r.output_token_ids)] for r in requests)
    assert all(r.output_token_ids == truth[tuple(r.prompt_token_ids)][:r.params.max_new_tokens] for r in done)


# ------------------------------------------------------------------------------------------------ the plan
def test_the_plan_resolves_speculation():
    cpu = torch.device("cpu")
    plan = resolve_plan(EngineConfig(speculative="ngram"), cpu)
    assert (plan.speculative, plan.num_speculative_tokens, plan.speculative_max_batch) == ("ngram", 4, 25)
    assert plan.is_reference                    # chapter 05's runner; the engine's step is chapter 11's
    plan = resolve_plan(EngineConfig(speculative="draft", num_speculative_tokens=7), cpu)
    assert (plan.speculative, plan.num_speculative_tokens, plan.speculative_max_batch) == ("draft", 7, 16)
    off = resolve_plan(EngineConfig(), cpu)
    assert (off.speculative, off.num_speculative_tokens, off.speculative_max_batch) == (None, 0, 0)
    # on a Hopper, overlap and async scheduling (on by default there) go off; graphs and multi-step decode stay
    hopper = resolve_plan(EngineConfig(), torch.device("cuda"), hardware=HOPPER)
    assert hopper.num_scheduler_steps == 8 and hopper.overlap_scheduling and hopper.async_scheduling
    spec = resolve_plan(EngineConfig(speculative="ngram"), torch.device("cuda"), hardware=HOPPER)
    assert spec.num_scheduler_steps == 8 and not spec.overlap_scheduling and not spec.async_scheduling
    assert spec.cuda_graphs and spec.piecewise_graphs and spec.speculative == "ngram"


@pytest.mark.parametrize("setting, value", [("tensor_parallel_size", 2), ("async_scheduling", True),
                                            ("overlap_scheduling", True)])
def test_the_plan_refuses_what_does_not_combine_by_name(setting, value):
    for device, hw in (("cpu", None), ("cuda", HOPPER)):
        with pytest.raises(ValueError, match=rf"^{'speculative' if setting == 'tensor_parallel_size' else setting}: "
                                             r".*(speculative|tensor_parallel_size)") as e:
            resolve_plan(EngineConfig(speculative="ngram", **{setting: value}), torch.device(device), hardware=hw)
        assert "speculative" in str(e.value) and setting in str(e.value)


def test_large_batches_draft_nothing(tiny_models):
    """Above `speculative_max_batch` running requests a step drafts nothing (the plan's per-step rule); at or
    below it, it drafts."""
    path = tiny_models["qwen3"]
    prompt = [1, 2, 3] * 4
    for num, drafts in ((26, False), (25, True)):
        llm = minirt.LLM(path, speculative="ngram", num_speculative_tokens=4)
        assert llm.engine.speculation.max_batch == 25
        outs = llm.generate([prompt] * num, SamplingParams(max_new_tokens=12))
        assert all(o.token_ids == hf_greedy(path, prompt, 12) for o in outs)
        assert (llm.engine.stats()["spec_num_drafts"] > 0) == drafts


def test_ngram_proposer_is_prompt_lookup():
    class R:
        token_ids = [5, 6, 7, 8, 5, 6]
    assert NgramProposer(1, 3).propose([R()], [2]) == [[7, 8]]
    assert NgramProposer(3, 3).propose([R()], [2]) == [[]]


def test_draft_model_greedy_output_equals_the_plain_engine_with_preemption():
    """The shipped draft model (`minirt.spec.draft_model.DraftModelProposer`) on the embedded model, in a pool small
    enough to preempt: the tokens equal the plain engine's, and its drafts are accepted often."""
    prompts = ["ROMEO:\nWhat light through yonder window breaks", "To be, or not to be, that is the question",
               "Of man's first disobedience, and the fruit", "KING HENRY:\nOnce more unto the breach"] * 2
    params = SamplingParams(max_new_tokens=32)
    plain = minirt.LLM(minirt.DEFAULT_MODEL, block_size=4).generate(prompts, params)
    llm = minirt.LLM(minirt.DEFAULT_MODEL, block_size=4, num_kv_blocks=40, speculative="draft",
                     num_speculative_tokens=4)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["spec_num_accepted_tokens"] > 0.2 * stats["spec_num_draft_tokens"]
    llm.engine.scheduler.check_invariants()


def test_steps_that_draft_nothing_run_bursts_of_multi_step_decode(tiny_models):
    """With multi-step decode in the plan, a batch above `speculative_max_batch` runs bursts (several tokens per
    request and step, no draft), and drafting resumes once the batch is small again; the tokens stay exact."""
    path, n = tiny_models["qwen2"], 24
    prompts = prompts_for(17, 6)
    truth = greedy_truth(path, prompts, n)
    llm = spec_llm(path, TruthProposer(truth, corrupt=0.3), k=3, block_size=4, num_scheduler_steps=4,
                   overlap_scheduling=False)
    llm.engine.speculation.max_batch = 3
    steps = []
    llm.engine.step_callbacks.append(lambda engine, batch: steps.append(len(engine.running_requests)))
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n - 3 * i) for i in range(6)])
    assert [o.token_ids for o in outs] == [truth[tuple(p)][:n - 3 * i] for i, p in enumerate(prompts)]
    stats = llm.engine.stats()
    assert stats["num_steps"] > len(steps)                      # some engine steps were bursts
    assert stats["spec_num_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
