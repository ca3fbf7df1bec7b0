"""`combine_o_proj` (a one-token step's split-KV combine and o_proj in one kernel) against the oracle: SDPA over the
sequence's keys, rounded to the model's dtype as attention's output is, times o_proj's weight in float64; and against
the two kernels it replaces (the combine kernel, then `linear_gemv`)."""

from __future__ import annotations

import pytest
import torch

from conftest import TRITON_DEVICE
from test_paged_attention import build_case, oracle

pytestmark = pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernels need CUDA or Triton's interpreter")
CUDA = torch.cuda.is_available()


def one_token_case(seed, num_heads, num_kv_heads, head_dim, dtype, out_features, bias, ctx=(200, 256)):
    """One decode's query, its paged K/V, the splits' partial results (16 splits, or 4 in the interpreter: at 200-256
    keys of context every one of its 64-key shares holds keys), an o_proj weight (and bias) and what the oracle says
    o_proj returns."""
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    device = TRITON_DEVICE
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(seed, 16, num_heads, num_kv_heads, head_dim, dtype, device,
                                                       num_seqs=1, ctx_range=ctx, lens=None)
    qs = [qs[0][-1:]]
    q = qs[0]
    meta.query_start_loc, meta.max_query_len = torch.arange(2, device=device), 1
    meta.slot_mapping = meta.slot_mapping[-1:]
    parts = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=4 if not CUDA else 16, partials=True)
    gen = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(out_features, num_heads * head_dim, generator=gen) / head_dim).to(dtype).to(device)
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    attended = oracle(ks, vs, qs).to(dtype).double().reshape(-1)          # attention's output in the model's dtype
    want = weight.double() @ attended + (b.double() if bias else 0)
    return (q, k_cache, v_cache, meta), parts, weight, b, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,bias", [(96, False), (100, True)], ids=["rows96", "rows100-bias"])
def test_combine_o_proj_matches_the_oracle(dtype, out_features, bias):
    """A row count that is not a multiple of the row tile, with and without a bias; counters zeroed afterwards."""
    from minirt.kernels.combine_o_proj_triton import combine_o_proj, counters_for

    if TRITON_DEVICE == "cpu" and dtype != torch.float32:
        pytest.skip("bfloat16 is checked on CUDA")
    _, parts, weight, b, want = one_token_case(7, 4, 2, 32, dtype, out_features, bias)
    counters = counters_for(out_features, weight.device, block_n=32)
    got = combine_o_proj(*parts, weight, b, counters, dtype, block_n=32)
    assert got.shape == (out_features,) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert counters.count_nonzero() == 0                  # zeroed again: the next launch counts from 0


def test_head_outputs_are_the_combine_kernels_bit_for_bit():
    """With o_proj the identity, each output row is one head's combined output (the other heads add zeros): the
    kernel's combine gives the combine kernel's bits, rounded as that kernel stores them."""
    from minirt.kernels.combine_o_proj_triton import combine_o_proj, counters_for
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    dtype = torch.bfloat16 if CUDA else torch.float32
    attention_inputs, parts, _, _, _ = one_token_case(11, 4, 2, 32, dtype, 8, False)
    splits = parts[0].shape[2]
    combined = paged_attention_triton(*attention_inputs, num_splits=splits).reshape(-1)
    eye = torch.eye(combined.numel(), dtype=dtype, device=combined.device)
    got = combine_o_proj(*parts, eye, None, counters_for(combined.numel(), eye.device, 32), dtype, block_n=32)
    assert torch.equal(got, combined)


@pytest.mark.skipif(not CUDA, reason="the two-kernel comparison at Qwen3-0.6B's shapes runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_as_the_combine_kernel_then_the_gemv_and_the_same_on_every_run(dtype):
    """At Qwen3-0.6B's shapes (16 heads of 128, o_proj 1024 rows): within float32 reassociation of the two kernels'
    result, and the same bits on 20 runs (the last program sums the heads in head order, whoever it is)."""
    from minirt.kernels.combine_o_proj_triton import combine_o_proj, counters_for
    from minirt.kernels.gemv_triton import linear_gemv
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    attention_inputs, parts, weight, _, want = one_token_case(5, 16, 8, 128, dtype, 1024, False, ctx=(600, 800))
    two_kernels = linear_gemv(paged_attention_triton(*attention_inputs).reshape(1, -1), weight)[0]
    counters = counters_for(1024, weight.device)
    runs = [combine_o_proj(*parts, weight, None, counters, dtype) for _ in range(20)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    if dtype == torch.float32:
        torch.testing.assert_close(runs[0], two_kernels, atol=1e-5, rtol=1e-5)
    else:     # one rounding to bf16 from sums that differ in their last float32 bits: at most one bf16 step apart
        step = torch.finfo(dtype).eps * two_kernels.float().abs() + 1e-6      # (+ 1e-6: results that cancel to ~0)
        assert ((runs[0].float() - two_kernels.float()).abs() <= step).all()
    torch.testing.assert_close(runs[0].double(), want, atol=2e-2 if dtype == torch.bfloat16 else 2e-5, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="PDL and CUDA graphs need CUDA")
def test_in_a_cuda_graph_with_pdl_behind_attention():
    """As a decode step runs it: attention's partials, then this kernel with PDL and the L2 prefetch of another
    weight, captured in one graph; every replay gives the two kernels' result and leaves the counters zeroed."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.combine_o_proj_triton import combine_o_proj, counters_for
    from minirt.kernels.gemv_triton import l2_prefetch_table
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    if pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {pdl_missing(torch.device('cuda'))}")
    dtype = torch.bfloat16
    attention_inputs, _, weight, _, _ = one_token_case(9, 16, 8, 128, dtype, 1024, False, ctx=(600, 800))
    expected = combine_o_proj(*paged_attention_triton(*attention_inputs, partials=True), weight, None,
                              counters_for(1024, weight.device), dtype)
    counters = counters_for(1024, weight.device)
    table = l2_prefetch_table([torch.zeros(3 * 1024 * 1024, dtype=dtype, device="cuda")])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):            # compile outside the capture
            parts = paged_attention_triton(*attention_inputs, pdl=True, partials=True)
            combine_o_proj(*parts, weight, None, counters, dtype, pdl=True, l2_prefetch=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parts = paged_attention_triton(*attention_inputs, pdl=True, partials=True)
        out = combine_o_proj(*parts, weight, None, counters, dtype, pdl=True, l2_prefetch=table)
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert counters.count_nonzero() == 0


def test_refuses_what_it_cannot_run():
    from minirt.kernels.combine_o_proj_triton import combine_o_proj, counters_for

    device = TRITON_DEVICE
    acc, m, l = torch.zeros(1, 4, 2, 32, device=device), torch.zeros(1, 4, 2, device=device), torch.ones(1, 4, 2, device=device)
    w = torch.zeros(64, 128, device=device)
    counters = counters_for(64, device)
    with pytest.raises(ValueError, match="part_acc"):
        combine_o_proj(acc[0], m, l, w, None, counters, torch.float32)
    with pytest.raises(ValueError, match="part_l"):
        combine_o_proj(acc, m, l[:, :, :1], w, None, counters, torch.float32)
    with pytest.raises(ValueError, match=r"weight: must be a contiguous torch.float32 \[N, 128\]"):
        combine_o_proj(acc, m, l, w[:, :64], None, counters, torch.float32)
    with pytest.raises(ValueError, match="bias"):
        combine_o_proj(acc, m, l, w, torch.zeros(63, device=device), counters, torch.float32)
    with pytest.raises(ValueError, match="counters"):
        combine_o_proj(acc, m, l, w, None, counters.float(), torch.float32)


def test_partials_without_split_kv_are_the_output():
    """`partials=True` returns the splits' results only where there are splits; one split: the output as usual."""
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    attention_inputs, parts, _, _, _ = one_token_case(3, 4, 2, 32, torch.float32, 8, False)
    assert isinstance(parts, tuple) and parts[0].shape[2] > 1
    got = paged_attention_triton(*attention_inputs, num_splits=1, partials=True)
    assert torch.equal(got, paged_attention_triton(*attention_inputs, num_splits=1))
