"""Verification steps through CUDA graphs of k + 1 rows per request (`DecodeGraphs(query_len=k + 1)`,
`FastModelRunner.forward_verify`, the plan's verify_graphs): greedy output with speculation equals transformers'
token for token whatever the drafts' lengths (shorter than k, none at all, cut by max_new_tokens); padding rows
write nothing but the scratch slot; the real rows' hidden states are the unpadded step's.

On the CPU the graphs run with `capture=False` (the same padded static buffers, eagerly, with the torch reference
kernel); on CUDA the engine captures them as its plan says (with verify_graphs=True).
Oracles: transformers' greedy generate (conftest.hf_greedy); the unpadded step through chapter 05's `ModelRunner`;
the KV cache's own contents before the step.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import minirt
from conftest import TRITON_DEVICE, VOCAB, hf_greedy
from minirt import SamplingParams
from minirt.attention import paged_attention_reference, store_kv
from minirt.config import cdiv
from minirt.fast.cuda_graphs import DecodeGraphs, capture_sizes
from minirt.fast.runner import FastModelRunner, build_verify_graphs
from minirt.kv.paged_cache import allocate_kv_cache
from minirt.model_runner import ModelRunner
from minirt.request import Request
from minirt.spec.proposer import Proposer
from test_spec_engine import prompts_for


class RaggedTruthProposer(Proposer):
    """The true greedy continuation (`truth[prompt]`), half the time as long as asked, else cut to a random shorter
    length (0: no draft), one of its tokens made wrong with probability `corrupt`: drafts of every length up to k,
    accepted in full, in part or not at all."""

    def __init__(self, truth: dict, corrupt: float = 0.3, seed: int = 0):
        self.truth, self.corrupt, self.rng = truth, corrupt, random.Random(seed)

    def propose(self, requests, num_tokens):
        drafts = []
        for request, k in zip(requests, num_tokens):
            n = request.num_output_tokens
            length = k if self.rng.random() < 0.5 else self.rng.randrange(k)
            draft = list(self.truth[tuple(request.prompt_token_ids)][n:n + length])
            if draft and self.rng.random() < self.corrupt:
                i = self.rng.randrange(len(draft))
                draft[i] = (draft[i] + 1) % VOCAB
            drafts.append(draft)
        return drafts


def verify_engine(path, device: str, k: int, block_size: int, max_batch: int, **settings) -> minirt.LLM:
    """An LLM with speculation (k draft tokens, drafting at any batch size) whose verification steps of running
    requests go through graphs of k + 1 rows per request, capture sizes up to `max_batch`. On CUDA the plan's own
    (verify_graphs=True). On the CPU a `FastModelRunner` as the plan builds it with CUDA graphs - decode graphs
    and verification graphs (`build_verify_graphs`) over one KV cache with a scratch block - run with capture=False
    and the torch reference kernel."""
    if device == "cuda":
        llm = minirt.LLM(path, device="cuda", dtype=torch.float32, block_size=block_size, speculative="ngram",
                         num_speculative_tokens=k, verify_graphs=True, max_num_seqs=max_batch, num_kv_blocks=1024,
                         max_num_batched_tokens=256, **settings)          # (fewer piecewise graphs to capture)
        assert llm.engine.plan.verify_graphs and llm.engine.model_runner.verify_graphs.graphs
        assert sorted(llm.engine.model_runner.verify_graphs.graphs) == capture_sizes(
            min(max_batch, llm.engine.plan.speculative_max_batch))
    else:
        llm = minirt.LLM(path, device="cpu", dtype=torch.float32, block_size=block_size, speculative="ngram",
                         num_speculative_tokens=k, **settings)
        assert not llm.engine.plan.verify_graphs                      # no CUDA here: the plan leaves them off
        engine = llm.engine
        cfg, n_blocks = engine.config, engine.pool.num_blocks
        plan = dataclasses.replace(engine.plan, cuda_graphs=True, verify_graphs=True)    # what the runner now runs
        kv_cache = allocate_kv_cache(engine.model.config, n_blocks + 1, block_size, torch.float32, torch.device("cpu"))
        decode = DecodeGraphs(engine.model, kv_cache, paged_attention_reference, store_kv, cfg.max_num_seqs,
                              cdiv(cfg.max_model_len, block_size), scratch_block=n_blocks, capture=False)
        verify = build_verify_graphs(plan, engine.model, kv_cache, paged_attention_reference, store_kv, max_batch,
                                     cfg.max_model_len, n_blocks, capture=False)
        engine.model_runner = FastModelRunner(engine.model, kv_cache, block_size, paged_attention_reference,
                                              store_kv, decode, verify_graphs=verify)
        engine.plan = plan
    llm.engine.speculation.max_batch = 10**6
    return llm


def watch_verify_graphs(llm) -> list[tuple[list[int], int]]:
    """Record each step that goes through the verification graphs (its rows per sequence, the capture size it
    replays), and check that every K/V write of its forward goes to a real row's slot or to the scratch slot."""
    graphs = llm.engine.model_runner.verify_graphs
    seen, written = [], []
    run_padded, store = graphs.run_padded, graphs.store

    def storing(k_cache, v_cache, k, v, slot_mapping):
        written.append(slot_mapping.detach().cpu().clone())
        return store(k_cache, v_cache, k, v, slot_mapping)

    def running(step):
        written.clear()
        counts = [b - a for a, b in zip(step.query_start_loc, step.query_start_loc[1:])]
        out = run_padded(step)
        seen.append((counts, min(s for s in graphs.sizes if s >= len(counts))))
        allowed = set(int(s) for s in step.slots) | {graphs.scratch_slot}
        if written:                                   # (none where graphs replay, or the rotary kernel writes K/V)
            assert set(torch.cat(written).tolist()) <= allowed, "a padding row wrote a request's slot"
        assert out.shape[0] == len(step.sample_rows)
        return out

    graphs.run_padded, graphs.store = running, storing
    return seen


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_through_the_verify_graphs_equals_transformers(tiny_models, family, device, block_size):
    """Six requests of different lengths (the batch shrinks from 6 to 1, through graphs of 1, 2, 4 and 7 sequences:
    batches of 6, 5 and 3 padded with whole sequences of padding rows), drafts of 0 to k tokens (requests without a
    draft in a step that drafts), some accepted in full, the last ones cut by max_new_tokens, one request ended by a
    stop id inside an accepted run. On the CPU with block size 4 the model runs chapter 07's merged projections."""
    path, n, k = tiny_models[family], 24, 3 if block_size == 1 else 5
    prompts = prompts_for(block_size)
    truth = {tuple(p): hf_greedy(path, p, n) for p in prompts}
    fast_modules = {"merge_projections": True} if device == "cpu" and block_size == 4 else {}   # (on CUDA: the plan's)
    llm = verify_engine(path, device, k, block_size, max_batch=7, **fast_modules)
    llm.engine.speculation.proposer = RaggedTruthProposer(truth, seed=block_size)
    seen = watch_verify_graphs(llm)
    lengths = [n - 3 * i for i in range(len(prompts))]
    stop = truth[tuple(prompts[1])][9]
    params = [SamplingParams(max_new_tokens=m, stop_token_ids=(stop,) if i == 1 else ()) for i, m in enumerate(lengths)]
    outs = llm.generate(prompts, params)
    for i, (p, o, m) in enumerate(zip(prompts, outs, lengths)):
        want = truth[tuple(p)][:m]
        if i == 1:
            want = want[:want.index(stop) + 1]
        assert o.token_ids == want, f"prompt {i}"
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["spec_num_accepted_tokens"] > 0
    rows = [c for counts, _ in seen for c in counts]
    assert seen and max(rows) == k + 1 and 1 in rows and any(1 < c <= k for c in rows)   # full, none and short
    assert any(len(counts) < size for counts, size in seen)                              # padding sequences
    llm.engine.scheduler.check_invariants()


def test_padding_rows_write_only_the_scratch_slot(tiny_model_path):
    """One verification step of three requests with 3, 1 and 2 rows under k = 3 (padded to 4 rows each, and a fourth
    sequence of padding), each request holding the blocks where its padding rows would stand: every slot but the
    real rows' and the scratch block's keeps its value (random, as if left by earlier requests), the real rows' K/V
    and hidden states equal the unpadded step's through chapter 05's runner. A step with more rows per sequence
    than the graphs' is refused by them, and the runner takes it the other way."""
    llm = minirt.LLM(tiny_model_path, device="cpu", dtype=torch.float32, block_size=4)
    model, B, n_blocks, q = llm.engine.model, 4, 40, 4
    kv_cache = allocate_kv_cache(model.config, n_blocks + 1, B, torch.float32, torch.device("cpu"))
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    before = kv_cache.clone()
    rng = random.Random(3)
    items, next_block = [], 0
    for i, (context, n) in enumerate([(13, 3), (6, 1), (9, 2)]):
        r = Request(f"r{i}", None, [rng.randrange(VOCAB) for _ in range(context)], SamplingParams(), frozenset())
        blocks = cdiv(context - n + q, B)                             # room for the padding rows' positions too
        r.block_table = list(range(next_block, next_block + blocks))[::-1]
        next_block += blocks
        r.num_computed_tokens = context - n
        items.append((r, n))
    runner = FastModelRunner(model, kv_cache, B, paged_attention_reference, store_kv)
    step = runner.prepare_lists(items)                                # numpy arrays, as the engine's verify has them
    step.sample_rows = list(range(len(step.input_ids)))
    reference_cache = before.clone()
    reference = ModelRunner(model, reference_cache, B)
    unpadded = reference.prepare_lists(items)
    unpadded.sample_rows = step.sample_rows
    want = reference.forward(unpadded)
    graphs = DecodeGraphs(model, kv_cache, paged_attention_reference, store_kv, 4, cdiv(64, B), n_blocks,
                          capture=False, query_len=q)
    got = graphs.run_padded(step)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    flat, ref, old = (c.flatten(2, 3) for c in (kv_cache, reference_cache, before))      # [layers, 2, slots, ...]
    real = torch.zeros(flat.shape[2], dtype=torch.bool)
    real[torch.as_tensor(step.slots)] = True
    kept = ~real
    kept[n_blocks * B:] = False                                       # the scratch block: padding rows write there
    assert torch.equal(flat[:, :, kept], old[:, :, kept]), "a padding row wrote a slot no real row owns"
    torch.testing.assert_close(flat[:, :, real], ref[:, :, real], atol=1e-5, rtol=1e-5)
    assert not torch.equal(flat[:, :, n_blocks * B], old[:, :, n_blocks * B])           # they did write the scratch
    items[0][0].num_computed_tokens -= 2
    items[0] = (items[0][0], q + 1)
    step = runner.prepare_lists(items)
    with pytest.raises(ValueError, match=r"^step: 3 sequences of up to 5 new tokens; these graphs take up to 4 "
                                         r"sequences of up to 4"):
        graphs.run_padded(step)
    runner.verify_graphs = graphs
    step.sample_rows = [0, 4]
    unpadded = reference.prepare_lists(items)
    unpadded.sample_rows = step.sample_rows
    torch.testing.assert_close(runner.forward_verify(step), reference.forward(unpadded), atol=1e-5, rtol=1e-5)


def test_the_plan_runs_verify_graphs_asked_for_and_refuses_them_by_name():
    """verify_graphs=None is off (never measured on a GPU); asked for, it runs where speculation and CUDA graphs with
    the Triton kernel all run, and where one of them is missing it is refused naming what is missing (flash-attn's
    kernel among them)."""
    from minirt.config import EngineConfig
    from minirt.fast.plan import Hardware, resolve_plan

    cuda, cpu, hopper = torch.device("cuda"), torch.device("cpu"), Hardware("cuda")
    assert resolve_plan(EngineConfig(speculative="ngram", verify_graphs=True), cuda, hardware=hopper).verify_graphs
    assert resolve_plan(EngineConfig(speculative="draft", num_speculative_tokens=8, verify_graphs=True), cuda,
                        hardware=hopper).verify_graphs
    for off in (dict(), dict(speculative="ngram"), dict(speculative="ngram", enforce_eager=True),
                dict(speculative="ngram", verify_graphs=False),
                dict(speculative="ngram", attention_backend="flash_attn")):
        assert not resolve_plan(EngineConfig(**off), cuda, hardware=hopper).verify_graphs, off
    assert not resolve_plan(EngineConfig(speculative="ngram"), cpu).verify_graphs
    for settings, words in (
            (dict(), r"needs speculative \(off: speculative=None\)$"),
            (dict(speculative="ngram", enforce_eager=True), r"needs CUDA graphs \(off: enforce_eager=True\)$"),
            (dict(speculative="ngram", attention_backend="flash_attn"),
             r"needs attention_backend='triton' \(off: attention_backend='flash_attn'\)$")):
        with pytest.raises(ValueError, match=r"^verify_graphs: CUDA graphs for verification steps " + words):
            resolve_plan(EngineConfig(verify_graphs=True, **settings), cuda, hardware=hopper)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("combine", [False, True], ids=["combine-kernel", "combine-in-attention"])
def test_the_verification_kernel_splits_uniform_rows_as_a_decode_batch(monkeypatch, combine):
    """`verify_kernel` (the attention the verification graphs capture): on a (stand-in) 132-SM GPU a step of 2
    sequences x 4 rows gets the split-KV of a 2-sequence decode batch, which `choose_num_splits` never gives rows of
    several tokens per sequence, and with the combine in the attention kernel its own counters, sized for 4 rows per
    sequence; its output matches SDPA. With split_kv off, or another backend, the plan's kernel is left as it is."""
    from test_paged_attention import build_case, oracle

    from minirt.fast.attention import verify_kernel
    from minirt.fast.plan import Plan
    from minirt.kernels import paged_attention_triton as module

    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    device = torch.device(TRITON_DEVICE)
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(4, 16, 4, 2, 32, torch.float32, device, lens=[(40, 4), (77, 4)])
    assert module.choose_num_splits(meta, 2, torch.device("cuda")) == 1
    calls = []

    def kernel(*args, **options):
        calls.append(options)
        return module.paged_attention_triton(*args, **options)

    plan = Plan(attention_backend="triton", split_kv=True, cuda_graphs=True, combine_in_attention=combine)
    got = verify_kernel(plan, kernel, 2, 4, 2, device)(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, oracle(ks, vs, qs), atol=2e-5, rtol=2e-5)
    assert calls[-1]["num_splits"] == module.splits_for(2 * 2, torch.device("cuda")) == 16
    counters = calls[-1].get("split_counters")
    assert (counters is not None and counters.numel() >= 2 * 2 * 4 and not counters.any()) == combine
    for other in (dataclasses.replace(plan, split_kv=False), Plan(attention_backend="torch")):
        assert verify_kernel(other, kernel, 2, 4, 2, device) is kernel
