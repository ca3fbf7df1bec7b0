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
    from lab.kernels.combine_o_proj_triton import paged_attention_partials

    device = TRITON_DEVICE
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(seed, 16, num_heads, num_kv_heads, head_dim, dtype, device,
                                                       num_seqs=1, ctx_range=ctx, lens=None)
    qs = [qs[0][-1:]]
    q = qs[0]
    meta.query_start_loc, meta.max_query_len = torch.arange(2, device=device), 1
    meta.slot_mapping = meta.slot_mapping[-1:]
    parts = paged_attention_partials(q, k_cache, v_cache, meta, num_splits=4 if not CUDA else 16)
    gen = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(out_features, num_heads * head_dim, generator=gen) / head_dim).to(dtype).to(device)
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    attended = oracle(ks, vs, qs).to(dtype).double().reshape(-1)          # attention's output in the model's dtype
    want = weight.double() @ attended + (b.double() if bias else 0)
    return (q, k_cache, v_cache, meta), parts, weight, b, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,bias", [(96, False), (100, False), (100, True)],
                         ids=["rows96", "rows100", "rows100-bias"])
def test_combine_o_proj_matches_the_oracle(dtype, out_features, bias):
    """A row count that is not a multiple of the row tile, with and without a bias; counters zeroed afterwards."""
    from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for

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
    """With o_proj a 0/1 matrix whose row i picks output i and one output of the next head, each output row is the
    sum of two head outputs (the other products add zeros, and two float32 sums of one value each add exactly): the
    kernel's combine gives the combine kernel's bits, rounded to the model's dtype as that kernel stores them
    before o_proj reads them (in bf16 on CUDA, where leaving that rounding out changes rows)."""
    from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    dtype = torch.bfloat16 if CUDA else torch.float32
    head_dim = 32
    attention_inputs, parts, _, _, _ = one_token_case(11, 4, 2, head_dim, dtype, 8, False)
    splits = parts[0].shape[2]
    combined = paged_attention_triton(*attention_inputs, num_splits=splits).reshape(-1)
    n = combined.numel()
    rows = torch.arange(n, device=combined.device)
    pick = torch.zeros(n, n, dtype=dtype, device=combined.device)
    pick[rows, rows] = 1
    pick[rows, (rows + head_dim) % n] = 1
    want = (combined.float() + combined.float()[(rows + head_dim) % n]).to(dtype)
    got = combine_o_proj(*parts, pick, None, counters_for(n, pick.device, 32), dtype, block_n=32)
    assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="the two-kernel comparison at Qwen3-0.6B's shapes runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_as_the_combine_kernel_then_the_gemv_and_the_same_on_every_run(dtype):
    """At Qwen3-0.6B's shapes (16 heads of 128, o_proj 1024 rows): within float32 reassociation of the two kernels'
    result, and the same bits on 20 runs (the last program sums the heads in head order, whoever it is)."""
    from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for
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
def test_in_a_cuda_graph_with_pdl_behind_a_slow_writer():
    """As a decode step runs it, with PDL and the L2 prefetch of another weight, captured in one graph: behind a
    kernel that spins for 1 ms before it writes the splits' partial results, which until then hold values that put
    o_proj far from the answer (checked first, so the test can fail). Every replay gives the bits the kernel gives
    without PDL, within one bf16 step of the combine kernel then `linear_gemv`, and leaves the counters zeroed."""
    from slow_copy import slow_copy

    from minirt.kernels import pdl_missing
    from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for
    from minirt.kernels.gemv_triton import l2_prefetch_table, linear_gemv
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    dtype = torch.bfloat16
    attention_inputs, fresh_parts, weight, _, _ = one_token_case(9, 16, 8, 128, dtype, 1024, False, ctx=(600, 800))
    two_kernels = linear_gemv(paged_attention_triton(*attention_inputs).reshape(1, -1), weight)[0]
    expected = combine_o_proj(*fresh_parts, weight, None, counters_for(1024, weight.device), dtype)
    fresh = torch.cat([t.flatten() for t in fresh_parts])
    flat = torch.empty_like(fresh)                        # the partials the kernel reads: views of one buffer
    sizes = [t.numel() for t in fresh_parts]
    parts = [view.view(t.shape) for view, t in zip(flat.split(sizes), fresh_parts)]
    stale = fresh.clone()
    stale[:sizes[0]] *= -4                                # every split's accumulator negated and scaled
    flat.copy_(stale)
    assert (combine_o_proj(*parts, weight, None, counters_for(1024, weight.device), dtype).float()
            - expected.float()).abs().max() > 2 * expected.float().abs().max()
    counters = counters_for(1024, weight.device)
    prefetched = torch.zeros(3 * 1024 * 1024, dtype=dtype, device="cuda")    # kept: the table holds its address
    table = l2_prefetch_table([prefetched])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):            # compile outside the capture
            slow_copy(fresh, flat, 0)
            combine_o_proj(*parts, weight, None, counters, dtype, pdl=True, l2_prefetch=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slow_copy(fresh, flat)
        out = combine_o_proj(*parts, weight, None, counters, dtype, pdl=True, l2_prefetch=table)
    for _ in range(3):
        flat.copy_(stale)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert counters.count_nonzero() == 0
    step = torch.finfo(dtype).eps * two_kernels.float().abs() + 1e-6
    assert ((expected.float() - two_kernels.float()).abs() <= step).all()


def test_refuses_what_it_cannot_run():
    from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for

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
    with pytest.raises(ValueError, match="bias: must be a contiguous"):
        combine_o_proj(acc, m, l, w, torch.zeros(64, 2, device=device)[:, 0], counters, torch.float32)
    with pytest.raises(ValueError, match="counters"):
        combine_o_proj(acc, m, l, w, None, counters.float(), torch.float32)
    with pytest.raises(ValueError, match="counters: must be a contiguous"):
        combine_o_proj(acc, m, l, w, None, counters_for(256, device)[::2], torch.float32)
    with pytest.raises(ValueError, match="l2_prefetch"):
        combine_o_proj(acc, m, l, w, None, counters, torch.float32, l2_prefetch=torch.zeros(4, 3, dtype=torch.int64,
                                                                                           device=device))
    with pytest.raises(ValueError, match="block_n: must be a power of two"):
        combine_o_proj(acc, m, l, w, None, counters_for(64, device, 48), torch.float32, block_n=48)
    with pytest.raises(ValueError, match="splits: must be a power of two"):
        combine_o_proj(acc[:, :, :1].expand(1, 4, 3, 32).contiguous(), m[:, :, :1].expand(1, 4, 3).contiguous(),
                       l[:, :, :1].expand(1, 4, 3).contiguous(), w, None, counters, torch.float32)


def test_partials_without_split_kv_are_the_output():
    """`paged_attention_partials` returns the splits' results only where there are splits; one split: the output as
    usual. Afterwards the engine's combine is back: the live kernel combines again."""
    from lab.kernels.combine_o_proj_triton import paged_attention_partials
    from minirt.kernels import paged_attention_triton as attention

    combine = attention._combine_splits_kernel
    attention_inputs, parts, _, _, _ = one_token_case(3, 4, 2, 32, torch.float32, 8, False)
    assert isinstance(parts, tuple) and parts[0].shape[2] > 1
    assert attention._combine_splits_kernel is combine
    got = paged_attention_partials(*attention_inputs, num_splits=1)
    assert torch.equal(got, attention.paged_attention_triton(*attention_inputs, num_splits=1))
