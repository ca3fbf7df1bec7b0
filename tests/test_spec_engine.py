"""Speculative decoding in the engine (`minirt.spec.engine`) is exact: greedy output equals transformers' greedy
output token for token, whatever the drafter proposes (n-gram lookup, the true continuation, garbage), the model
family, the block size, chunked prefill, prefix-cache hits and preemption; sampled output is drawn from the
target's own distribution (chi-square against the exact distribution computed from transformers' logits); stops
hold inside an accepted run; blocks never leak; and the plan refuses what does not combine, by name.

Oracles: `transformers`' greedy generate (tests/conftest.py `hf_greedy`), its logits for the exact distribution,
the plain engine's own output where a tokenizer is needed (stop strings), and `Scheduler.check_invariants`.
"""

from __future__ import annotations

import dataclasses
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
    # on a Hopper everything of the plain plan stays: graphs, multi-step decode, overlap and async scheduling
    hopper = resolve_plan(EngineConfig(), torch.device("cuda"), hardware=HOPPER)
    assert hopper.num_scheduler_steps == 8 and hopper.overlap_scheduling and hopper.async_scheduling
    spec = resolve_plan(EngineConfig(speculative="ngram"), torch.device("cuda"), hardware=HOPPER)
    assert spec == dataclasses.replace(hopper, speculative="ngram", num_speculative_tokens=4, speculative_max_batch=25)
    # asked for by name with speculation, they run (on the CPU overlap needs bursts: num_scheduler_steps > 1)
    asked = resolve_plan(EngineConfig(speculative="ngram", async_scheduling=True, overlap_scheduling=True,
                                      num_scheduler_steps=4), torch.device("cpu"))
    assert asked.async_scheduling and asked.overlap_scheduling and asked.num_scheduler_steps == 4


def test_the_plan_refuses_speculation_with_tensor_parallelism_by_name():
    for device, hw in (("cpu", None), ("cuda", HOPPER)):
        with pytest.raises(ValueError, match=r"^speculative: .*tensor_parallel_size=1 \(got 2"):
            resolve_plan(EngineConfig(speculative="ngram", tensor_parallel_size=2), torch.device(device), hardware=hw)


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


# ------------------------------------------------------------------------------------------------ with overlap and async
# Steps that draft nothing (a running batch above `max_batch`, or no draft proposed) run as the plain engine's step
# function runs them: bursts launched before the one before is taken (overlap scheduling) and steps with prefill
# chunks launched before the one before is taken (async scheduling). A drafting step first takes what is in flight.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MAX_STEPS = 2000                    # far more than any of these loads takes: a step that makes no progress fails


class InFlight:
    """A spy on the fast runner: what it has launched and not handed back yet (bursts: `start_decode_steps`,
    `continue_decode_steps` -> `finish_decode_steps`; single steps: `launch_step` -> `finish_step`), so independent of
    the engine's own bookkeeping. For each engine step (`step_fn`) it notes the running batch at its start, the
    decision point; `behind` lists ("burst" or "step", that batch) for every launch made while another was in flight
    (overlap and async scheduling at work), `verified` (that batch, launched and not taken, drafts) for every
    verification. Checks the scheduler's invariants after every step."""

    def __init__(self, llm):
        engine = self.engine = llm.engine
        runner, speculation = engine.model_runner, engine.speculation
        self.pending, self.behind, self.verified, self.at_start = [], [], [], 0
        self.preempted_in_flight = 0
        start, cont, finish = runner.start_decode_steps, runner.continue_decode_steps, runner.finish_decode_steps
        launch, finish_step, verify = runner.launch_step, runner.finish_step, speculation.verify
        preempt, step_fn = engine.scheduler.preempt, engine.step_fn

        def starting(items, num_steps):
            return self.launched(start(items, num_steps), None)

        def continuing(burst, num_steps):
            assert any(p is burst for p in self.pending)
            return self.launched(cont(burst, num_steps), "burst")

        def launching(items, previous=None):
            assert previous is None or any(p is previous for p in self.pending)
            return self.launched(launch(items, previous), None if previous is None else "step")

        def verifying(batch):
            drafts = len(engine.scheduler.drafts)
            self.verified.append((self.at_start, len(self.pending), drafts))
            return verify(batch)

        def preempting(request):
            self.preempted_in_flight += bool(self.pending)
            return preempt(request)

        def stepping():
            self.at_start = len(engine.running_requests)
            progress = step_fn()
            engine.scheduler.check_invariants()
            return progress

        runner.start_decode_steps, runner.continue_decode_steps = starting, continuing
        runner.finish_decode_steps = lambda burst: finish(self.taken(burst))
        runner.launch_step, runner.finish_step = launching, lambda step: finish_step(self.taken(step))
        speculation.verify, engine.scheduler.preempt, engine.step_fn = verifying, preempting, stepping

    def launched(self, work, behind: str | None):
        if behind is not None:
            self.behind.append((behind, self.at_start))
        self.pending.append(work)
        return work

    def taken(self, work):
        self.pending = [p for p in self.pending if p is not work]
        return work

    def check(self, max_batch: int, at_least: int = 2) -> None:
        """Every verification ran with nothing in flight, at a batch of 1..max_batch, with drafts; bursts and steps
        with prefill chunks were launched behind another (`at_least` of each) in steps above max_batch (and with no
        request running, where no step drafts), never in a step that might draft."""
        assert self.verified and all(pending == 0 and 0 < batch <= max_batch and drafts > 0
                                     for batch, pending, drafts in self.verified), self.verified
        assert all(b == 0 or b > max_batch for _, b in self.behind), self.behind
        for kind in ("burst", "step"):
            assert sum(k == kind and b > max_batch for k, b in self.behind) >= at_least, (kind, self.behind)


class GreedyTruth(TruthProposer):
    """`TruthProposer` for greedy requests; a sampled request is never drafted."""

    def propose(self, requests, num_tokens):
        return [super(GreedyTruth, self).propose([r], [k])[0] if r.params.greedy else []
                for r, k in zip(requests, num_tokens)]


def drive(llm, waves, params_of, max_batch: int) -> list:
    """Submit `waves[0]`, step the engine, and submit each next wave once the running batch has come down to
    `max_batch` or below after being above it (or the engine is idle); returns the requests in submission order."""
    engine = llm.engine
    requests = [engine._add_request(p, params_of(p)) for p in waves[0]]
    waves, above = list(waves[1:]), False
    for _ in range(MAX_STEPS):
        if not (engine.scheduler.has_work() or waves):
            return requests
        running = len(engine.running_requests)
        above = above or running > max_batch
        if waves and ((above and running <= max_batch) or not engine.scheduler.has_work()):
            requests += [engine._add_request(p, params_of(p)) for p in waves.pop(0)]
            above = False
        assert engine.step_fn()
    raise AssertionError(f"not done after {MAX_STEPS} engine steps")


def build_overlapped(path, device: str, how: str, k: int = 3, **settings) -> minirt.LLM:
    """An LLM with n-gram speculation, bursts of 4 decode steps, overlap and async scheduling: on CUDA with the
    rest of the plan's defaults ("graphs": CUDA graphs, piecewise graphs, the Triton kernels); on the CPU the fast
    runner eagerly ("eager"), or its decode steps through the decode graphs' static buffers ("static buffers")."""
    settings = dict(speculative="ngram", num_speculative_tokens=k, async_scheduling=True, **settings)
    if how == "static buffers":
        from test_cuda_graphs import padded_engine

        return padded_engine(path, num_scheduler_steps=4, **settings)
    settings = {"num_kv_blocks": 1024, **settings} if device == "cuda" else settings
    return minirt.LLM(path, device=device, dtype=torch.float32, block_size=4, num_scheduler_steps=4, **settings)


CASES = [(d, h) for d in DEVICES for h in (["eager", "static buffers"] if d == "cpu" else ["graphs"])]


@pytest.mark.gpu
@pytest.mark.parametrize("device, how", CASES)
def test_greedy_equals_transformers_as_the_batch_crosses_max_batch(tiny_models, device, how):
    """Requests arrive in three waves, each admitted in chunks of at most 5 tokens under a budget of 16 while
    earlier ones decode, and end one after another: the running batch crosses `max_batch` (3) upwards and downwards
    several times. Above it the steps run bursts and prefill chunks launched behind the step in flight; at or below
    it they verify drafts, with nothing in flight. Every request gets transformers' tokens, and every block is free
    at the end."""
    path, max_batch = tiny_models["qwen3"], 3
    rng = random.Random(31)
    prompts = prompts_for(31, 14)
    ns = {tuple(p): rng.randrange(6, 30) for p in prompts}
    truth = greedy_truth(path, prompts, 30)
    llm = build_overlapped(path, device, how, max_num_seqs=6, max_num_batched_tokens=16, max_prefill_chunk=5)
    llm.engine.speculation.proposer = proposer = TruthProposer(truth, corrupt=0.3)
    llm.engine.scheduler.on_remove = proposer.remove
    llm.engine.speculation.max_batch = max_batch
    spy = InFlight(llm)
    requests = drive(llm, [prompts[:7], prompts[7:11], prompts[11:]],
                     lambda p: SamplingParams(max_new_tokens=ns[tuple(p)], ignore_eos=True), max_batch)
    for r in requests:
        want = truth[tuple(r.prompt_token_ids)][:r.params.max_new_tokens]
        assert r.output_token_ids == want and r.finish_reason == "length", r.request_id
    spy.check(max_batch)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0 and stats["num_steps"] > len(spy.verified)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not proposer.live


def test_seeded_sampling_draws_as_without_speculation_where_nothing_is_drafted(tiny_models):
    """Seeded sampled requests that are never drafted, beside greedy ones that are, as the batch crosses
    `max_batch`: each sampled request draws exactly the tokens it draws from the plain engine of the same settings
    (bursts, overlap and async scheduling alike), in the steps that run as the plain engine's and in verification
    steps beside drafted requests; each greedy one gets transformers' tokens."""
    path, max_batch = tiny_models["qwen2"], 2
    prompts = prompts_for(33, 12)
    truth = greedy_truth(path, prompts, 30)
    params = [SamplingParams(max_new_tokens=30 - i, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(max_new_tokens=6 + 2 * i, ignore_eos=True, temperature=0.7 + 0.1 * i, top_k=i % 4 * 5,
                             top_p=0.9 if i % 2 else 1.0, seed=100 + i) for i in range(len(prompts))]
    of = {tuple(p): sp for p, sp in zip(prompts, params)}
    kw = dict(max_num_seqs=5, max_num_batched_tokens=12, max_prefill_chunk=4)
    llm = build_overlapped(path, "cpu", "eager", **kw)
    llm.engine.speculation.proposer = proposer = GreedyTruth(truth, corrupt=0.3)
    llm.engine.scheduler.on_remove = proposer.remove
    llm.engine.speculation.max_batch = max_batch
    spy = InFlight(llm)
    verify, beside = llm.engine.speculation.verify, []
    llm.engine.speculation.verify = lambda batch: beside.append(
        sum(not r.params.greedy for r, _ in batch.items)) or verify(batch)
    got = drive(llm, [prompts[:5], prompts[5:9], prompts[9:]], lambda p: of[tuple(p)], max_batch)
    plain = minirt.LLM(path, device="cpu", dtype=torch.float32, block_size=4, num_scheduler_steps=4,
                       async_scheduling=True, **kw).generate(prompts, params)
    assert [r.output_token_ids for r in got] == [o.token_ids for o in plain]
    for p, r in zip(prompts, got):
        if r.params.greedy:
            assert r.output_token_ids == truth[tuple(p)][:r.params.max_new_tokens]
    spy.check(max_batch)
    assert any(beside), beside                       # sampled requests verified beside drafted ones
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES)
def test_aborts_and_preemption_while_a_step_is_in_flight(tiny_models, device):
    """A pool small enough to preempt, and requests aborted while a step or burst that computes them is in flight
    (after an engine step that left it launched): the others still get transformers' tokens, an aborted one a prefix
    of them, the bookkeeping holds after every step, and every block is free at the end."""
    path, max_batch = tiny_models["llama"], 1
    prompts = prompts_for(35, 16)
    truth = greedy_truth(path, prompts, 18)
    llm = build_overlapped(path, device, "eager" if device == "cpu" else "graphs", max_num_seqs=8,
                           max_num_batched_tokens=12, max_prefill_chunk=5, num_kv_blocks=20)
    engine = llm.engine
    engine.speculation.proposer = proposer = TruthProposer(truth, corrupt=0.3)
    engine.scheduler.on_remove = proposer.remove
    engine.speculation.max_batch = max_batch
    spy = InFlight(llm)
    requests = [engine._add_request(p, SamplingParams(max_new_tokens=18, ignore_eos=True)) for p in prompts]
    aborted, chances = [], 0
    for _ in range(MAX_STEPS):
        if not engine.scheduler.has_work():
            break
        assert engine.step_fn()
        in_flight = [r for work in spy.pending for r in work.requests if not r.is_finished]
        chances += bool(in_flight)
        if in_flight and chances % 3 == 0 and len(aborted) < 4:     # the step in flight computes it
            aborted.append(in_flight[-1])
            assert engine.abort(in_flight[-1].request_id)
            engine.scheduler.check_invariants()
    assert not engine.scheduler.has_work()
    assert len(aborted) == 4 and engine.scheduler.num_preemptions > 0 and spy.preempted_in_flight > 0
    for r in requests:
        want = truth[tuple(r.prompt_token_ids)]
        if r in aborted:
            assert r.finish_reason == "abort" and r.output_token_ids == want[:len(r.output_token_ids)]
        else:
            assert r.finish_reason == "length" and r.output_token_ids == want, r.request_id
    spy.check(max_batch)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not engine.requests and not proposer.live


def test_the_draft_model_catches_up_after_overlapped_bursts():
    """The draft model (a drafter with a KV cache of its own) beside bursts, overlap and async scheduling, in a pool
    that preempts: between its drafting steps the requests gain whole bursts of tokens it has not seen, and it
    catches up from their tokens; the output equals the plain engine's and every block of both is free at the end."""
    prompts = ["ROMEO:\nWhat light through yonder window breaks", "To be, or not to be, that is the question",
               "Of man's first disobedience, and the fruit", "KING HENRY:\nOnce more unto the breach"] * 3
    params = SamplingParams(max_new_tokens=40)
    plain = minirt.LLM(minirt.DEFAULT_MODEL, block_size=4).generate(prompts, params)
    llm = minirt.LLM(minirt.DEFAULT_MODEL, block_size=4, num_kv_blocks=60, speculative="draft",
                     num_speculative_tokens=4, num_scheduler_steps=4, async_scheduling=True,
                     max_num_batched_tokens=64, max_prefill_chunk=16)
    llm.engine.speculation.max_batch = 4
    spy = InFlight(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    spy.check(4, at_least=1)
    stats, drafter = llm.engine.stats(), llm.engine.speculation.proposer
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert drafter.pool.num_free_blocks == drafter.pool.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_with_speculation_taking_a_bursts_tokens_does_not_wait_for_the_next_burst(tiny_models):
    """On the GPU, above `max_batch`: the host takes a burst's tokens while the GPU runs the burst launched after
    it, as without speculation (tests/test_multi_step.py's test of the same name)."""
    from conftest import hold_the_gpu_after

    path = tiny_models["llama"]
    llm = minirt.LLM(path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=4, num_kv_blocks=256,
                     speculative="ngram")
    assert llm.engine.plan.overlap_scheduling and llm.engine.plan.async_scheduling
    llm.engine.speculation.max_batch = 1
    seen = hold_the_gpu_after(llm.engine.model_runner, "continue_decode_steps", "finish_decode_steps")
    prompts = prompts_for(37, 3)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 30) for p in prompts]
    assert seen == [False], "taking the burst's tokens waited for the work launched after it"
