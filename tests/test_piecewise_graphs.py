"""Piecewise CUDA graphs for steps with prefill chunks (minirt.fast.piecewise_graphs): padded static-buffer forwards,
attention between the pieces, give transformers' tokens.

On the CPU the padding logic runs with `capture=False` (the same static buffers, padding tokens and scratch slot,
each attention call made where it stands) with the torch reference kernel, both with the backend writing K/V and with
the rotation writing it inside the pieces; on CUDA the captured pieces run for real.
Oracle: transformers greedy (conftest.hf_greedy).
"""

import random

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts
from minirt.attention import paged_attention_reference, store_kv
from minirt.fast import Plan
from minirt.fast.layers import speed_up_model
from minirt.fast.ops import ModelKernels, norm_rotate_and_store
from minirt.fast.piecewise_graphs import PiecewiseGraphs, capture_sizes
from minirt.fast.runner import FastModelRunner, padded_rows
from minirt.kv.paged_cache import allocate_kv_cache
from test_cuda_graphs import spy_on          # the token counts of the steps that went through `run`


def greedy(n):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("max_tokens", [1, 10, 16, 40, 700, 1024, 5000, 8192])
def test_capture_sizes_cover_every_step(max_tokens):
    sizes = capture_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for n in range(1, max_tokens + 1):       # padding below 1024 tokens: under 2x (or up to 16); above: under 1024
        padded = min(s for s in sizes if s >= n)
        assert padded - n < (max(n, 16) if n <= 1024 else 1024)


def watch_the_static_forward(pieces: PiecewiseGraphs) -> tuple[list[int], set[int]]:
    """Record the size each static-buffer forward runs at, and every KV-cache slot a step writes other than its own
    slots (`attn.meta.slot_mapping`) and the scratch block's."""
    forwards, stray = [], set()
    forward, run = pieces._forward, pieces.run
    kv = pieces.kv_cache                                     # [layers, 2, blocks, block_size, Hkv, D]
    block_size = kv.shape[3]
    scratch = set(range(pieces.scratch_slot, pieces.scratch_slot + block_size))

    def by_slot(t):
        return t.permute(2, 3, 0, 1, 4, 5).reshape(kv.shape[2] * block_size, -1)

    def recording_forward(size, attn):
        forwards.append(size)
        return forward(size, attn)

    def checked_run(input_ids, positions, attn):
        before = kv.clone()
        out = run(input_ids, positions, attn)
        written = torch.nonzero((by_slot(kv) != by_slot(before)).any(dim=1)).flatten().tolist()
        stray.update(set(written) - set(attn.meta.slot_mapping.tolist()) - scratch)
        return out

    pieces._forward, pieces.run = recording_forward, checked_run
    return forwards, stray


def piecewise_engine(path, kv_write_in_rotary: bool, **kw) -> "minirt.LLM":
    """An LLM whose runner sends every step through `PiecewiseGraphs(capture=False)` (no decode graphs), with the torch
    reference kernel; with kv_write_in_rotary, the model's rotation writes K/V (`norm_rotate_and_store`), inside what
    would be the pieces, and the backend only attends."""
    llm = minirt.LLM(model=path, device="cpu", dtype=torch.float32, block_size=4, **kw)
    engine = llm.engine
    if kv_write_in_rotary:
        speed_up_model(engine.model, Plan(), ModelKernels(rotate_and_store=norm_rotate_and_store))
    n_blocks = engine.pool.num_blocks
    kv_cache = allocate_kv_cache(engine.model.config, n_blocks + 1, 4, torch.float32, torch.device("cpu"))
    backend_store = (lambda *a: pytest.fail("the backend wrote K/V")) if kv_write_in_rotary else store_kv
    pieces = PiecewiseGraphs(engine.model, kv_cache, paged_attention_reference, backend_store,
                             engine.config.max_num_batched_tokens, scratch_block=n_blocks, capture=False)
    engine.model_runner = FastModelRunner(engine.model, kv_cache, 4, paged_attention_reference, backend_store,
                                          None, pieces)
    return llm


@pytest.mark.parametrize("kv_write_in_rotary", [False, True], ids=["backend-writes-kv", "rotation-writes-kv"])
def test_padded_piecewise_buffers_on_cpu(tiny_model_path, kv_write_in_rotary):
    """Chunked prefill with decodes mixed in, then decodes, through the static buffers (steps of 40 tokens, then
    smaller ones padded to 16 and 32, whose padding would overwrite earlier steps' K/V if it kept their slots), and
    a second wave of prompts sharing a cached prefix: transformers' tokens, every block free at the end."""
    llm = piecewise_engine(tiny_model_path, kv_write_in_rotary, max_num_seqs=6, max_num_batched_tokens=40,
                           max_prefill_chunk=24)
    engine = llm.engine
    pieces = engine.model_runner.piecewise_graphs
    forwards, stray = watch_the_static_forward(pieces)
    seen = spy_on(pieces)
    rng = random.Random(3)
    prompts = random_prompts(21, [rng.randint(5, 30) for _ in range(7)])
    prompts += [prompts[0][:20] + p for p in random_prompts(22, [3, 9])]      # a cached prefix of 5 blocks
    ns = [rng.randint(2, 12) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}"
    assert forwards == [pieces.size_for(t) for t in seen]               # every step ran padded to its size
    assert {16, 32, 40} <= set(forwards) and any(t < 16 for t in seen), f"steps seen: {sorted(set(seen))}"
    assert not stray, f"K/V written outside the steps' slots and the scratch block: slots {sorted(stray)[:8]}"
    assert engine.stats()["num_free_blocks"] == engine.pool.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kv_write_in_rotary", [False, None], ids=["backend-writes-kv", "default"])
def test_piecewise_graphs_equal_transformers(tiny_model_path, kv_write_in_rotary):
    """The captured pieces (one more than the model has layers, per size), float32: chunked prefill, decodes mixed
    in, a cached prefix; the tokens of transformers, and the plan without the switch builds no pieces."""
    kw = dict(device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=8, num_kv_blocks=1024,
              max_num_batched_tokens=96, max_prefill_chunk=40, kv_write_in_rotary=kv_write_in_rotary)
    llm = minirt.LLM(model=tiny_model_path, **kw)
    pieces = llm.engine.model_runner.piecewise_graphs
    assert llm.engine.plan.piecewise_graphs and sorted(pieces.pieces) == capture_sizes(96)
    layers = llm.engine.model.config.num_hidden_layers
    assert all(len(p.graphs) == layers + 1 and len(p.calls) == layers for p in pieces.pieces.values())
    forwards, stray = watch_the_static_forward(pieces)
    seen = spy_on(pieces)
    rng = random.Random(8)
    prompts = random_prompts(23, [rng.randint(5, 70) for _ in range(12)])
    prompts += [prompts[1][:36] + p for p in random_prompts(24, [4, 17])]
    ns = [rng.randint(1, 20) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
    assert len({pieces.size_for(t) for t in seen}) >= 3, f"steps seen: {sorted(set(seen))}"
    assert not forwards, "a step ran the static-buffer forward eagerly instead of replaying the pieces"
    assert not stray, f"K/V written outside the steps' slots and the scratch block: slots {sorted(stray)[:8]}"
    off = minirt.LLM(model=tiny_model_path, **kw, piecewise_graphs=False)
    assert not off.engine.plan.piecewise_graphs and off.engine.model_runner.piecewise_graphs is None


def test_a_step_above_the_largest_size_is_refused_by_name(tiny_model_path):
    pieces = piecewise_engine(tiny_model_path, False, max_num_batched_tokens=40).engine.model_runner.piecewise_graphs
    with pytest.raises(ValueError, match=r"^num_tokens: 41 is not in 1 \.\. 40"):
        pieces.size_for(41)


def test_the_warm_up_attends_like_a_step_with_prefill_chunks(tiny_model_path):
    """The warm-up before each capture attends with `padding_meta`: one sequence of `size` new tokens on the scratch
    block, so its launch is the kind steps with chunks make (one program per sequence, never split-KV). A batch of
    one-token rows instead would be a decode launch, with split-KV and, with the combine in the attention kernel,
    more sequences than its counters were sized for (`max_num_seqs`): on the H200 that refused to build the engine."""
    from minirt.kernels.paged_attention_triton import choose_num_splits

    llm = piecewise_engine(tiny_model_path, False, max_num_seqs=1, max_num_batched_tokens=40)
    pieces = llm.engine.model_runner.piecewise_graphs
    for size in pieces.sizes:
        meta = pieces.padding_meta(size)
        assert meta.max_query_len == meta.max_context_len == size and meta.query_start_loc.tolist() == [0, size]
        assert meta.context_lens.tolist() == [size] and meta.block_tables.shape == (1, -(-size // 4))
        assert (meta.block_tables == pieces.scratch_slot // 4).all() and (meta.slot_mapping == pieces.scratch_slot).all()
        assert choose_num_splits(meta, 8, torch.device("cuda")) == 1           # whatever the GPU: chunks never split


@pytest.mark.parametrize("kv_write_in_rotary", [False, True], ids=["backend-writes-kv", "rotation-writes-kv"])
def test_attention_calls_keep_only_the_static_buffers(tiny_model_path, kv_write_in_rotary):
    """What a capture keeps of each attention call (its `_Call`) points into the static buffers every layer and size
    shares, never into an activation of its own: otherwise each captured piece would hold one q (or q/k/v) per layer
    and size in the graphs' pool for the engine's lifetime."""
    from minirt.fast.piecewise_graphs import _PieceAttention

    pieces = piecewise_engine(tiny_model_path, kv_write_in_rotary, max_num_batched_tokens=40).engine.model_runner\
        .piecewise_graphs
    static = {pieces.buffers[name].untyped_storage().data_ptr() for name in ("q", "k", "v", "out")}
    for size in pieces.sizes:
        calls = []
        pieces._forward(size, _PieceAttention(pieces, size, lambda call: calls.append(call) or call.out))
        assert len(calls) == pieces.model.config.num_hidden_layers
        assert all(len(c.inputs) == (1 if kv_write_in_rotary else 3) for c in calls)
        assert {t.untyped_storage().data_ptr() for c in calls for t in (*c.inputs, c.out)} <= static


def test_greedy_sampler_pads_rows_to_its_sizes(tiny_model_path):
    """With `sample_sizes` set (on CUDA, the decode graphs' batch sizes, warmed up at construction), a greedy step's
    sampled rows are padded with zero rows to the next size before the LM head, and their tokens cut back: every LM
    head call sees one of the sizes (or more rows than the largest, unpadded), some steps needed the padding, and
    the tokens are transformers'."""
    llm = piecewise_engine(tiny_model_path, False, max_num_seqs=6, max_num_batched_tokens=40, max_prefill_chunk=24)
    runner = llm.engine.model_runner
    runner.sample_sizes = [2, 5]
    head, rows, wanted = runner.model.lm_head, [], []
    head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    sample, got = runner.sample, []

    def watched(hidden, requests):
        wanted.append(len(requests))
        got.append(sample(hidden, requests))
        return got[-1]

    runner.sample = watched
    rng = random.Random(9)
    prompts = random_prompts(25, [rng.randint(5, 30) for _ in range(7)])
    ns = [rng.randint(2, 12) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}"
    assert rows == [padded_rows(n, [2, 5]) for n in wanted], (rows, wanted)
    assert [len(tokens) for tokens in got] == wanted                          # the padding's tokens cut off
    assert {1, 4} & set(wanted) and 6 in wanted, sorted(set(wanted))         # padded, and unpadded past 5
    assert [padded_rows(r, [1, 2, 4, 16]) for r in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, 17]
