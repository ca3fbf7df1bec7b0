"""`gemv_chain` (a layer's four matrix-vector products in one persistent kernel, phases split by grid barriers)
against two oracles: the four `linear_gemv` calls it replaces, bit for bit (the same tiles through the same code),
and the chain computed in float64 with torch (`rms_norm`, `F.linear`, `silu`).

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`), one launch per phase; on CUDA one launch
with its barriers, also inside a CUDA graph and with PDL, at Qwen3-0.6B's shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or Triton's interpreter")
# (K1 hidden, N1 q/k/v rows, K2 o_proj's input, I intermediate): tiny on the interpreter, Qwen3-0.6B on CUDA
SHAPES = [(64, 96, 32, 48), (100, 40, 24, 30)] + ([(1024, 4096, 2048, 3072)] if CUDA else [])


def make_layer(k1, n1, k2, inter, dtype, seed=0, with_residual=True):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)  # noqa: E731
    x = rnd(1, k1)
    residual = rnd(1, k1) if with_residual else None
    weights = (rnd(n1, k1, scale=k1 ** -0.5), rnd(k1, k2, scale=k2 ** -0.5), rnd(2 * inter, k1, scale=k1 ** -0.5),
               rnd(k1, inter, scale=inter ** -0.5))
    norms = (1 + rnd(k1, scale=0.3), 1 + rnd(k1, scale=0.3))
    return x, residual, weights, norms


def unfused(x, residual, weights, norms, pdl=False):
    """The four `linear_gemv` calls of the chain, as `lab/probes/gemv.py --chain` makes them."""
    from minirt.kernels.gemv_triton import linear_gemv

    qkv, s1 = linear_gemv(x, weights[0], norm_weight=norms[0], residual=residual, pdl=pdl)
    o = linear_gemv(qkv[:, :weights[1].shape[1]], weights[1], pdl=pdl)
    act, s2 = linear_gemv(o, weights[2], silu_and_mul=True, norm_weight=norms[1], residual=s1, pdl=pdl)
    return qkv, s1, o, act, s2, linear_gemv(act, weights[3], pdl=pdl)


@needs_kernel
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_chain_equals_the_four_gemvs_bit_for_bit(shape, dtype, with_residual):
    from lab.kernels.gemv_chain_triton import gemv_chain

    x, residual, weights, norms = make_layer(*shape, dtype, with_residual=with_residual)
    got = gemv_chain(x, weights, norms, residual)
    want = unfused(x, residual, weights, norms)
    for name, a, b in zip(got._fields, got, want):
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_chain_matches_float64(shape):
    """The same chain in float64 torch, rounded where the model rounds (the streams, gate and up, the outputs)."""
    from lab.kernels.gemv_chain_triton import gemv_chain

    x, residual, weights, norms = make_layer(*shape, torch.float32)
    got = gemv_chain(x, weights, norms, residual)
    d = lambda t: t.double()  # noqa: E731

    def norm(s, g):
        return d(s) * torch.rsqrt(d(s).pow(2).mean(-1, keepdim=True) + 1e-6) * d(g)

    s1 = residual + x
    qkv = F.linear(norm(s1, norms[0]), d(weights[0]))
    o = F.linear(qkv[:, :weights[1].shape[1]], d(weights[1]))
    s2 = (s1 + o.float())                                  # float32 sum, as the kernel rounds the stream
    gate, up = F.linear(norm(s2, norms[1]), d(weights[2])).chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = F.linear(act, d(weights[3]))
    assert torch.equal(got.stream_attn, s1)
    for name, ref in (("qkv", qkv), ("o", o), ("act", act), ("out", out)):
        value = getattr(got, name).double()
        assert (value - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@pytest.mark.skipif(not CUDA, reason="the barriers and CUDA graphs need CUDA")
@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
def test_chain_in_a_cuda_graph_of_layers(pdl):
    """28 layers of chains in one CUDA graph, each with its own zeroed count (one memset for all), replayed twice:
    every output equal to the unfused chains' replayed the same way."""
    from minirt.kernels import pdl_missing
    from lab.kernels.gemv_chain_triton import gemv_chain

    if pdl and pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {pdl_missing(torch.device('cuda'))}")
    layers = [make_layer(1024, 4096, 2048, 3072, torch.bfloat16, seed=i) for i in range(28)]
    x0 = layers[0][0]
    sync = torch.zeros(len(layers), dtype=torch.int32, device="cuda")

    def step(fused):
        x, stream = x0, None
        if fused:
            sync.zero_()
        for i, (_, _, weights, norms) in enumerate(layers):
            outs = (gemv_chain(x, weights, norms, stream, sync=sync[i:i + 1], pdl=pdl) if fused
                    else unfused(x, stream, weights, norms, pdl=pdl))
            x, stream = outs[-1], outs[4]
        return x, stream

    results = {}
    for fused in (False, True):
        step(fused)                                      # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(fused)
        graph.replay()
        graph.replay()                                   # the counts start from zero again on every replay
        torch.cuda.synchronize()
        results[fused] = [t.clone() for t in out]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


def test_chain_argument_errors():
    pytest.importorskip("triton")
    from lab.kernels.gemv_chain_triton import gemv_chain

    x, residual, weights, norms = make_layer(64, 96, 32, 48, torch.float32)
    too_wide = torch.zeros(64, 97)                       # o_proj reading more q/k/v outputs than there are
    with pytest.raises(ValueError, match="weights"):
        gemv_chain(x, (weights[0], too_wide, weights[2], weights[3]), norms, residual)
    with pytest.raises(ValueError, match="W_gate_up"):
        gemv_chain(x, (weights[0], weights[1], weights[2][:-1], weights[3]), norms, residual)
    with pytest.raises(ValueError, match="residual"):
        gemv_chain(x, weights, norms, residual[:, :10])
    with pytest.raises(ValueError, match="norm_weights"):
        gemv_chain(x, weights, (norms[0].double(), norms[1]), residual)


def test_resident_programs_respects_every_limit_of_an_sm():
    """The grid of a barrier kernel must fit on the GPU at once: the programs per SM are bounded by warps (64),
    registers (65,536 32-bit), thread blocks (32) and shared memory, whichever is first; 1 when unknown."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from lab.kernels.gemv_chain_triton import resident_programs

    def compiled(n_regs, warps, shared=0):
        return SimpleNamespace(n_regs=n_regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))

    dev = torch.device("cpu")
    assert resident_programs(compiled(32, 4), dev, 8) == 8                 # 8 x 4 warps x 128 threads x 32 regs fits
    assert resident_programs(compiled(128, 4), dev, 8) == 4                # 65,536 / (128 x 32 x 4)
    assert resident_programs(compiled(16, 16), dev, 8) == 4                # 64 warps / 16
    assert resident_programs(compiled(16, 1), dev, 64) == 32               # thread blocks
    assert resident_programs(compiled(32, 4, shared=100 * 1024), dev, 8) == 2
    assert resident_programs(compiled(255, 8), dev, 8) == 1                # never fewer than one
    assert resident_programs(SimpleNamespace(), dev, 8) == 1               # the interpreter's kernels say nothing
