"""CUDA graphs for decode (minirt.fast.cuda_graphs): padded static-buffer forwards give transformers' tokens.

On the CPU the padding logic runs with `capture=False` (the same static buffers, padding rows and scratch
slot, run eagerly with the torch reference kernel); on CUDA the captured graphs run for real.
Oracle: transformers greedy (conftest.hf_greedy).
"""

import dataclasses
import random

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts
from minirt.attention import paged_attention_reference, store_kv
from minirt.config import cdiv
from minirt.fast.cuda_graphs import DecodeGraphs, capture_sizes
from minirt.fast.runner import FastModelRunner
from minirt.kv.paged_cache import allocate_kv_cache


def greedy(n):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 16, 17, 256])
def test_capture_sizes_cover_every_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):    # every batch size has a graph at most 2x (and at most 15 rows) larger
        padded = min(s for s in sizes if s >= n)
        assert padded - n <= max(n, 15) if n >= 8 else padded < 2 * n


def spy_on(graphs) -> list[int]:
    """The batch sizes (token counts) of the steps that went through `graphs.run` (decode or piecewise graphs)."""
    sizes = []
    run = graphs.run

    def counting_run(input_ids, *args):
        sizes.append(len(input_ids))
        return run(input_ids, *args)

    graphs.run = counting_run
    return sizes


def padded_engine(path, num_scheduler_steps: int = 1, overlap_scheduling: bool | None = None, **kw) -> "minirt.LLM":
    """An LLM whose runner (a `FastModelRunner`, as the plan builds it with CUDA graphs) sends every
    one-token-per-sequence step through `DecodeGraphs(capture=False)`, with the torch reference kernel. The plan's
    scheduler and step (multi-step decode, overlap scheduling) are the engine's own, built from these settings;
    overlap_scheduling: None = on with bursts (the plan's default)."""
    llm = minirt.LLM(model=path, device="cpu", dtype=torch.float32, block_size=4,
                     num_scheduler_steps=num_scheduler_steps, overlap_scheduling=overlap_scheduling, **kw)
    engine = llm.engine
    n_blocks, cfg = engine.pool.num_blocks, engine.config
    kv_cache = allocate_kv_cache(engine.model.config, n_blocks + 1, 4, torch.float32, torch.device("cpu"))
    graphs = DecodeGraphs(engine.model, kv_cache, paged_attention_reference, store_kv, cfg.max_num_seqs,
                          cdiv(cfg.max_model_len, 4), scratch_block=n_blocks, capture=False)
    engine.model_runner = FastModelRunner(engine.model, kv_cache, 4, paged_attention_reference, store_kv, graphs)
    engine.plan = dataclasses.replace(engine.plan, cuda_graphs=True)      # what the runner now runs
    return llm


def test_one_token_prefill_chunks_through_the_graph_path(tiny_model_path):
    """Steps of 1-token rows that are not all sampled (max_prefill_chunk=1: chunks that do not finish
    their prompt) go through the graph path too; only the sampled rows' tokens may reach the requests."""
    llm = padded_engine(tiny_model_path, max_num_seqs=4, max_prefill_chunk=1)
    used = spy_on(llm.engine.model_runner.decode_graphs)
    prompts = random_prompts(13, [9, 2, 5, 1, 7])          # the longest first: it is still prefilling while others decode
    ns = [6, 8, 3, 7, 5]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}"
    assert used, "the graph path was never taken"


def test_padded_decode_buffers_on_cpu(tiny_model_path):
    """Batches of 1..5 decodes padded to sizes 1, 2, 4, 5 through the static buffers equal transformers
    (with chapter 07's other switches on too: merged projections, fused elementwise ops)."""
    assert not minirt.LLM(model=tiny_model_path, device="cpu").engine.plan.cuda_graphs          # not on CPUs
    llm = padded_engine(tiny_model_path, max_num_seqs=5, merge_projections=True, fused_ops=True)
    engine, n_blocks = llm.engine, llm.engine.pool.num_blocks
    used = spy_on(engine.model_runner.decode_graphs)
    rng = random.Random(5)
    prompts = random_prompts(7, [rng.randint(1, 13) for _ in range(7)])
    ns = [rng.randint(2, 11) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n)
    assert {3, 5} <= set(used), f"decode batch sizes seen: {sorted(set(used))}"   # 3 pads to 4; 5 is a size
    assert engine.stats()["num_free_blocks"] == n_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("fused_ops", [False, True])
def test_cuda_graphs_equal_transformers(tiny_model_path, fused_ops):
    llm = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=24,
                     num_kv_blocks=2048, fused_ops=fused_ops)
    graphs = llm.engine.model_runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == capture_sizes(24)
    assert llm.engine.plan.gemv and llm.engine.model.lm_head.gemv is not None    # gemv=None: on with graphs
    used = spy_on(graphs)
    rng = random.Random(9)
    prompts = random_prompts(11, [rng.randint(1, 40) for _ in range(30)])
    ns = [rng.randint(1, 30) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
    # Bursts go on past a request's last token, so a batch's size changes rarely: batches of chosen sizes, each
    # starting its decode steps with all its requests (every one has tokens to go after the prefill's)
    for k in (1, 3, 5, 9, 17):
        more = [rng.randint(2, 30) for _ in range(k)]
        for p, o, n in zip(prompts, llm.generate(prompts[:k], [greedy(n) for n in more]), more):
            assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
    assert {1, 3, 5, 9, 17} <= set(used), f"decode batch sizes seen: {sorted(set(used))}"
    eager = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=24,
                       num_kv_blocks=2048, enforce_eager=True)
    assert eager.engine.model_runner.decode_graphs is None
    assert not eager.engine.plan.gemv and not hasattr(eager.engine.model.lm_head, "gemv")   # and off without them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("pdl,fused", [(False, False), (None, None), (None, True)],
                         ids=["no-pdl", "pdl-auto", "all-on"])
def test_batch1_decode_with_norm_in_gemv_equals_transformers(tiny_model_path, pdl, fused):
    """One request at a time, so every decode step takes the one-row path of chapter 07's last switches: the
    norms in the GEMV's prologue (on by default with the GEMV), where the GPU has it PDL and the GEMVs' L2 prefetch
    of the next weights (on by default with PDL), the K/V write in the rotary kernel (on by default with it) and
    (all-on) the split-KV combine in the attention kernel."""
    from minirt.kernels import pdl_missing

    llm = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=1,
                     num_kv_blocks=512, pdl=pdl, kv_write_in_rotary=fused, combine_in_attention=bool(fused))
    from minirt.fast.layers import NormInGemvLayer

    plan = llm.engine.plan
    assert plan.norm_in_gemv and isinstance(llm.engine.model.model.layers[0], NormInGemvLayer)
    kernel = llm.engine.model_runner.kernel
    want_pdl = pdl is None and not pdl_missing(torch.device("cuda"))
    assert plan.pdl == kernel.keywords["pdl"] == want_pdl
    qkv_gemv = llm.engine.model.model.layers[0].self_attn.qkv_proj.gemv
    assert plan.l2_prefetch == want_pdl == ("l2_prefetch" in getattr(qkv_gemv, "keywords", {}))
    assert plan.combine_in_attention == ("split_counters" in kernel.keywords) == bool(fused)
    assert plan.kv_write_in_rotary == (llm.engine.model.model.layers[0].self_attn.rotate_and_store is not None) \
        == (fused is not False)
    rng = random.Random(5)
    prompts = random_prompts(13, [rng.randint(1, 40) for _ in range(6)])
    ns = [rng.randint(1, 30) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
