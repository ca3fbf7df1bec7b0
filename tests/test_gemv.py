"""`linear_gemv` (the Triton matrix-vector product for one-row decode steps) against an oracle:
`torch.nn.functional.linear` in float64 on the same inputs.

The kernel cases need CUDA, or Triton's interpreter (`TRITON_INTERPRET=1`, which runs the kernel on CPU
tensors; small shapes only, it is slow). The argument checks need Triton importable, nothing else.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SHAPES = [(1024, 4096), (3072, 1024), (2048, 1024), (1024, 6144), (100, 7), (1024, 151936)]   # (K, N)
# Relative to the output's largest magnitude: float32 sums of a few thousand products stay near 1e-6;
# a bf16 output is rounded to 8 significant bits (2**-8 ~ 4e-3 of each value).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (block_n, block_k, split_k, num_warps) besides the default: tails in N and K, split-K with uneven shares.
CONFIGS = [(1, 64, 1, 1), (4, 32, 2, 2), (16, 16, 4, 1), (2, 128, 8, 4)]


def random_weight(n, k, gen, dtype, device, method=None):
    """A random `[n, k]` weight for linear_gemv: (weight, weight_scale, the float64 weight the oracle multiplies).
    method None: weight in dtype, no scale; "int8" / "fp8": chapter 10's one-byte weight and its per-channel
    scales (`minirt.quant.formats.quantize`), the oracle's weight `dequantize`'s values."""
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    if method is None:
        w = w.to(dtype)
        return w.to(device), None, w.double()
    from minirt.quant.formats import dequantize, quantize

    w[:, 0] *= 8                                          # an outlier column: rows' scales differ
    q, scale = quantize(w, method)
    return q.to(device), scale.to(device), dequantize(q, scale).double()


def check_linear_gemv(k, n, with_bias, x_lead, dtype, device, config=None, seed=0, silu_and_mul=False,
                      method=None):
    """Fresh random inputs; linear_gemv's output must match the float64 oracle in shape, dtype and values.
    silu_and_mul: the oracle is `silu(gate) * up` of the two halves of the float64 product. method: quantized
    weights with per-channel scales (`random_weight`)."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*x_lead, k, generator=gen).to(dtype).to(device)
    w, w_scale, w_ref = random_weight(n, k, gen, dtype, device, method)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    out = linear_gemv(x, w, b, config=GemvConfig(*config) if config else None, silu_and_mul=silu_and_mul,
                      weight_scale=w_scale)
    ref = F.linear(x.double(), w_ref, None if b is None else b.double())
    if silu_and_mul:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    assert out.shape == ref.shape and out.dtype == dtype and out.device == x.device
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()        # NaN (an unwritten output) fails the comparison
    rounds = 3 if silu_and_mul else 1                     # as unfused: gate, up and their product are rounded
    assert err <= rounds * TOL[dtype] * scale, f"max |out - ref| = {err:.3g}, {err / scale:.3g} of the output scale"


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("x_lead", [(1,), (1, 1)], ids=["x2d", "x3d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
def test_gemv_matches_linear_cuda(k, n, with_bias, x_lead, dtype):
    check_linear_gemv(k, n, with_bias, x_lead, dtype, "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("k,n", [(100, 7), (3072, 1024), (1000, 333)])
def test_gemv_configs_cuda(k, n, config, dtype):
    check_linear_gemv(k, n, True, (1,), dtype, "cuda", config)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("config", [None, (2, 128, 4, 4)], ids=["default", "splitk"])
def test_gemv_in_cuda_graph(config):
    """Captured once, replayed on new x: no host syncs or data-dependent allocations in the call."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    cfg = GemvConfig(*config) if config else None
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    linear_gemv(x, w, b, config=cfg)                      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_gemv(x, w, b, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = F.linear(x.double(), w.double(), b.double())
        assert (out.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None] + CONFIGS, ids=str)
@pytest.mark.parametrize("k,n", [(100, 7), (256, 64), (1000, 33)])
def test_gemv_matches_linear_interpreter(k, n, config, dtype):
    pytest.importorskip("triton")
    check_linear_gemv(k, n, True, (1, 1), dtype, "cpu", config)


# Configs for the SiLU-and-multiply epilogue: it never splits K.
GATED_CONFIGS = [(1, 64, 1, 1), (4, 32, 1, 2), (16, 16, 1, 1)]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None] + GATED_CONFIGS, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", [(1024, 6144), (100, 14), (1000, 666)])
def test_gemv_silu_and_mul_cuda(k, n, with_bias, config, dtype):
    check_linear_gemv(k, n, with_bias, (1, 1), dtype, "cuda", config, silu_and_mul=True)


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None] + GATED_CONFIGS, ids=str)
@pytest.mark.parametrize("k,n", [(100, 14), (256, 64), (1000, 34)])
def test_gemv_silu_and_mul_interpreter(k, n, config, dtype):
    pytest.importorskip("triton")
    check_linear_gemv(k, n, True, (1,), dtype, "cpu", config, silu_and_mul=True)


def check_norm_prologue(k, n, with_bias, with_residual, silu_and_mul, dtype, device, config=None, pdl=False, seed=0,
                        eps=1e-6, scale=1.0, method=None):
    """linear_gemv with the RMSNorm (and residual addition) in its prologue against the float64 oracle
    `F.linear(rms_norm(s))` with `s = residual + x` added in dtype, as the model adds its stream; the stream it
    returns must be exactly that s. `scale` multiplies x and the residual: small inputs make eps matter. method:
    quantized weights with per-channel scales (`random_weight`)."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(1, 1, k, generator=gen)).to(dtype).to(device)
    res = (scale * torch.randn(1, 1, k, generator=gen)).to(dtype).to(device) if with_residual else None
    g = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype).to(device)
    w, w_scale, w_ref = random_weight(n, k, gen, dtype, device, method)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    out, stream = linear_gemv(x, w, b, config=GemvConfig(*config) if config else None, silu_and_mul=silu_and_mul,
                              norm_weight=g, eps=eps, residual=res, pdl=pdl, weight_scale=w_scale)
    s = x if res is None else res + x
    assert stream.shape == x.shape and stream.dtype == dtype
    if device == "cuda":
        assert torch.equal(stream, s)          # the same float32 sum, rounded to nearest-even
    else:                                      # Triton's interpreter may round the bf16 cast the other way
        torch.testing.assert_close(stream, s, rtol=2 ** -7, atol=0)
    sd = s.double()
    normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    ref = F.linear(normed, w_ref, None if b is None else b.double())
    if silu_and_mul:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    assert out.shape == ref.shape and out.dtype == dtype
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()
    rounds = 3 if silu_and_mul else 1
    assert err <= rounds * TOL[dtype] * scale, f"max |out - ref| = {err:.3g}, {err / scale:.3g} of the output scale"


NORM_CASES = [(False, False, False), (True, True, False), (False, True, True), (True, False, True)]  # bias, res, silu


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None] + GATED_CONFIGS, ids=str)
@pytest.mark.parametrize("with_bias,with_residual,silu_and_mul", NORM_CASES, ids=str)
@pytest.mark.parametrize("k,n", [(1024, 4096), (1024, 6144), (100, 14), (1000, 666)])
def test_gemv_norm_prologue_cuda(k, n, with_bias, with_residual, silu_and_mul, config, dtype):
    check_norm_prologue(k, n, with_bias, with_residual, silu_and_mul, dtype, "cuda", config)


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None] + GATED_CONFIGS, ids=str)
@pytest.mark.parametrize("with_bias,with_residual,silu_and_mul", NORM_CASES, ids=str)
@pytest.mark.parametrize("k,n", [(100, 14), (256, 64), (1000, 34)])
def test_gemv_norm_prologue_interpreter(k, n, with_bias, with_residual, silu_and_mul, config, dtype):
    pytest.importorskip("triton")
    check_norm_prologue(k, n, with_bias, with_residual, silu_and_mul, dtype, "cpu", config)


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("eps,scale", [(0.5, 1.0), (1e-2, 0.05)], ids=["eps0.5", "small-inputs"])
def test_gemv_norm_prologue_uses_eps(eps, scale):
    """eps inside the square root, as given: inputs whose mean square is comparable to eps tell it apart."""
    pytest.importorskip("triton")
    check_norm_prologue(100, 14, True, True, False, torch.float32, "cuda" if CUDA else "cpu", eps=eps, scale=scale)
    check_norm_prologue(100, 14, False, True, True, torch.float32, "cuda" if CUDA else "cpu", eps=eps, scale=scale)


def pdl_missing_here() -> list[str]:
    from minirt.kernels import pdl_missing

    return pdl_missing(torch.device("cuda")) if CUDA else ["CUDA"]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("config", [None, (2, 128, 4, 4)], ids=["default", "splitk"])
def test_gemv_pdl_chain_in_cuda_graph(config):
    """A chain of PDL launches (each GEMV's x is the one before's output, as in a decode step) captured and
    replayed: every result equals the same chain without PDL, so no kernel read its x before it was written."""
    if missing := pdl_missing_here():
        pytest.skip(f"PDL needs {missing}")
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    cfg = GemvConfig(*config) if config else None
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(1024, 1024, generator=gen) / 32).to(torch.bfloat16).cuda() for _ in range(6)]
    g = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        h, stream = x, None
        for i, w in enumerate(ws):
            if i % 2:
                h, stream = linear_gemv(h, w, norm_weight=g, residual=stream, pdl=pdl)
            else:
                h = linear_gemv(h, w, config=cfg, pdl=pdl)
        return h, stream

    chain(True)                                            # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = chain(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref, ref_stream = chain(False)
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(stream, ref_stream)


QUANT_CASES = [("int8", False, None), ("fp8", False, None), ("fp8", False, (4, 32, 2, 2)), ("int8", True, None),
               ("fp8", True, (4, 32, 1, 2))]      # method, silu_and_mul, config (split-K among them)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,silu_and_mul,config", QUANT_CASES, ids=str)
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (1024, 6144), (1000, 666)])
def test_gemv_quantized_weights_cuda(k, n, method, silu_and_mul, config, dtype):
    check_linear_gemv(k, n, True, (1, 1), dtype, "cuda", config, silu_and_mul=silu_and_mul, method=method)
    if config is None or config[2] == 1:
        check_norm_prologue(k, n, True, True, silu_and_mul, dtype, "cuda", config, method=method)


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,silu_and_mul,config", QUANT_CASES, ids=str)
@pytest.mark.parametrize("k,n", [(100, 14), (256, 64)])
def test_gemv_quantized_weights_interpreter(k, n, method, silu_and_mul, config, dtype):
    """One-byte weights with per-channel scales (chapter 10): the product with `dequantize`'s weight, plain, with
    SiLU-and-multiply, split-K, and with the norm prologue."""
    pytest.importorskip("triton")
    check_linear_gemv(k, n, True, (1,), dtype, "cpu", config, silu_and_mul=silu_and_mul, method=method)
    if config is None or config[2] == 1:
        check_norm_prologue(k, n, True, True, silu_and_mul, dtype, "cpu", config, method=method)


def test_gemv_argument_errors():
    """Each bad argument is named; the checks run before any kernel, so CPU tensors do."""
    pytest.importorskip("triton")
    from minirt.kernels.gemv_triton import linear_gemv

    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"^x: must have exactly one row"):
        linear_gemv(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match=r"^x: must have exactly one row"):
        linear_gemv(torch.randn(1, 2, 16), w)
    with pytest.raises(ValueError, match=r"^weight: must be \[N, 12\]"):
        linear_gemv(torch.randn(1, 12), w)
    with pytest.raises(ValueError, match=r"^weight: must be contiguous"):
        linear_gemv(torch.randn(1, 8), torch.randn(8, 16).t())
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\]"):
        linear_gemv(torch.randn(1, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\]"):
        linear_gemv(torch.randn(1, 16), w, torch.randn(16)[::2])
    with pytest.raises(ValueError, match=r"^weight: must be torch.float32"):
        linear_gemv(torch.randn(1, 16), w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"^weight: silu_and_mul needs gate and up rows, an even count, got 7"):
        linear_gemv(torch.randn(1, 16), torch.randn(7, 16), silu_and_mul=True)
    from minirt.kernels.gemv_triton import GemvConfig

    with pytest.raises(ValueError, match=r"^config: silu_and_mul, norm_weight and argmax_key never split K"):
        linear_gemv(torch.randn(1, 16), w, config=GemvConfig(1, 16, 2), silu_and_mul=True)
    with pytest.raises(ValueError, match=r"^config: silu_and_mul, norm_weight and argmax_key never split K"):
        linear_gemv(torch.randn(1, 16), w, config=GemvConfig(1, 16, 2), norm_weight=torch.ones(16))
    key = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^config: silu_and_mul, norm_weight and argmax_key never split K"):
        linear_gemv(torch.randn(1, 16), w, config=GemvConfig(1, 16, 2), argmax_key=key)
    with pytest.raises(ValueError, match=r"^argmax_key: must be an int64 \[1\] tensor on cpu, got torch.int32"):
        linear_gemv(torch.randn(1, 16), w, argmax_key=key.int())
    with pytest.raises(ValueError, match=r"^argmax_key: must be an int64 \[1\] tensor on cpu, got torch.int64 \(2,\)"):
        linear_gemv(torch.randn(1, 16), w, argmax_key=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^argmax_key: the argmax of a SiLU-and-multiply product is not a sampler's"):
        linear_gemv(torch.randn(1, 16), w, silu_and_mul=True, argmax_key=key)
    with pytest.raises(ValueError, match=r"^weight: the argmax needs at least one row, got none"):
        linear_gemv(torch.randn(1, 16), torch.randn(0, 16), argmax_key=key)
    with pytest.raises(ValueError, match=r"^norm_weight: must be a contiguous \[16\]"):
        linear_gemv(torch.randn(1, 16), w, norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match=r"^residual: is added in the norm's prologue, so it needs norm_weight"):
        linear_gemv(torch.randn(1, 16), w, residual=torch.randn(1, 16))
    with pytest.raises(ValueError, match=r"^residual: must be contiguous with x's shape \(1, 16\)"):
        linear_gemv(torch.randn(1, 16), w, norm_weight=torch.ones(16), residual=torch.randn(16))
    with pytest.raises(ValueError, match=r"^norm_weight: must be torch.float32"):
        linear_gemv(torch.randn(1, 16), w, norm_weight=torch.ones(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^pdl: programmatic dependent launch needs a CUDA device \(got cpu\)"):
        linear_gemv(torch.randn(1, 16), w, pdl=True)
    with pytest.raises(ValueError, match=r"^l2_prefetch: the bulk prefetch into L2 needs a CUDA device \(got cpu\)"):
        linear_gemv(torch.randn(1, 16), w, l2_prefetch=torch.zeros(1, 2, dtype=torch.int64))
    q, scale = w.to(torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match=r"^weight: with weight_scale, must be int8 or float8_e4m3fn on cpu, got "
                                         r"torch.float32"):
        linear_gemv(torch.randn(1, 16), w, weight_scale=scale)
    with pytest.raises(ValueError, match=r"^weight: must be torch.float32 on cpu like x, got torch.int8"):
        linear_gemv(torch.randn(1, 16), q)
    with pytest.raises(ValueError, match=r"^weight_scale: must be a contiguous float32 \[8\] \(one scale per output "
                                         r"channel\) on cpu, got torch.float32 \(4,\)"):
        linear_gemv(torch.randn(1, 16), q, weight_scale=torch.ones(4))
    with pytest.raises(ValueError, match=r"^weight_scale: must be a contiguous float32 \[8\].*got torch.float16"):
        linear_gemv(torch.randn(1, 16), q, weight_scale=scale.half())


def check_argmax(k, n, with_bias, norm, dtype, device, config=None, seed=0, pdl=False, ties=()):
    """linear_gemv with argmax_key against torch.argmax of the logits linear_gemv returns for the same call without
    it (the tokens a greedy step took before the argmax moved into the epilogue): the same index, an int64 of x's
    leading shape, and the key back at 0. ties: pairs (i, j), row j made a copy of row i, so that their logits are
    equal and the first must win."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5)
    b = torch.randn(n, generator=gen) if with_bias else None
    for i, j in ties:
        w[j] = w[i]
        if b is not None:
            b[j] = b[i]
    w, b = w.to(dtype).to(device), None if b is None else b.to(dtype).to(device)
    kw = dict(config=GemvConfig(*config) if config else None, pdl=pdl)
    if norm:
        kw.update(norm_weight=(1 + 0.3 * torch.randn(k, generator=gen)).to(dtype).to(device),
                  residual=torch.randn(1, 1, k, generator=gen).to(dtype).to(device))
    key = torch.zeros(1, dtype=torch.int64, device=device)
    got = linear_gemv(x, w, b, argmax_key=key, **kw)
    logits = linear_gemv(x, w, b, **kw)
    if norm:
        (got, stream), (logits, ref_stream) = got, logits
        assert torch.equal(stream, ref_stream)
    want = logits.argmax(dim=-1)
    assert got.shape == want.shape == (1, 1) and got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, want), (got, want, logits.max())
    assert key.item() == 0
    for i, j in ties:
        if want.item() in (i, j):
            assert got.item() == i
    return got


ARGMAX_CASES = [(100, 7), (256, 64), (200, 133)]      # (K, N); a tail tile, and programs that end on N


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias,norm", [(False, False), (True, True)], ids=["plain", "bias-norm"])
@pytest.mark.parametrize("config", [None, (1, 64, 1, 1), (16, 16, 1, 1)], ids=str)
@pytest.mark.parametrize("k,n", ARGMAX_CASES)
def test_gemv_argmax_interpreter(k, n, with_bias, norm, config, dtype):
    check_argmax(k, n, with_bias, norm, dtype, "cpu", config)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias,norm", [(False, False), (True, True)], ids=["plain", "bias-norm"])
@pytest.mark.parametrize("k,n", ARGMAX_CASES + [(1000, 333), (1024, 151936)])
def test_gemv_argmax_cuda(k, n, with_bias, norm, dtype):
    check_argmax(k, n, with_bias, norm, dtype, "cuda")


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_argmax_orders_nan_as_torch_argmax(dtype):
    """NaN logits, as a broken model gives them: torch.argmax puts any NaN above every number (the first NaN row
    wins), and so must the epilogue's argmax. NaN rows in two programs of 8-row tiles, a row of +inf between them, a
    NaN weight of either sign; and with no NaN, the inf row."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    device = "cuda" if CUDA else "cpu"
    key = torch.zeros(1, dtype=torch.int64, device=device)
    x = torch.ones(1, 16, dtype=dtype, device=device)
    for nan_rows, sign in (((37, 50), 1.0), ((37, 50), -1.0), ((50, 37), -1.0), ((), 1.0)):
        w = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
        w[20, 0] = float("inf")
        for row in nan_rows:
            w[row, 3] = sign * float("nan")
        logits = linear_gemv(x, w, config=GemvConfig(8, 16, 1, 1))
        want = logits.argmax(dim=-1).item()
        assert want == (min(nan_rows) if nan_rows else 20)           # the oracle's order, checked first
        assert linear_gemv(x, w, argmax_key=key, config=GemvConfig(8, 16, 1, 1)).item() == want, (nan_rows, sign)
        assert key.item() == 0


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_argmax_takes_the_first_of_equal_logits(dtype):
    """Equal logits in rows of different programs (8-row tiles: rows 3 and 60, 5 and 6 in one) and the largest
    among negative ones: the lowest row wins, as torch.argmax's."""
    from minirt.kernels.gemv_triton import GemvConfig, linear_gemv

    device = "cuda" if CUDA else "cpu"
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        best = int(torch.randint(0, 64, (1,), generator=gen))
        ties = [(best, 60 if best < 60 else 2), (5, 6)]
        check_argmax(32, 64, False, False, dtype, device, (8, 32, 1, 1), seed, ties=ties)
    key = torch.zeros(1, dtype=torch.int64, device=device)
    x = torch.ones(1, 16, dtype=dtype, device=device)
    w = torch.zeros(64, 16, dtype=dtype, device=device)
    assert linear_gemv(x, w, argmax_key=key, config=GemvConfig(8, 16, 1, 1)).item() == 0    # all logits 0
    w -= torch.arange(64, 0, -1, device=device).to(dtype)[:, None]      # all negative, the last row largest
    w[40] = w[63]
    assert linear_gemv(x, w, argmax_key=key, config=GemvConfig(8, 16, 1, 1)).item() == 40
    w.zero_()                    # float32 sums 2 and 2 + 2**-7: equal once rounded to bf16 (to even), so row 3 wins
    w[3, :2], w[40, 0], w[40, 1] = 1.0, 1.0, 1 + 2 ** -7
    want = linear_gemv(x, w).argmax(dim=-1).item()
    assert want == (3 if dtype == torch.bfloat16 else 40)
    assert linear_gemv(x, w, argmax_key=key, config=GemvConfig(8, 16, 1, 1)).item() == want
    assert key.item() == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
def test_gemv_argmax_in_cuda_graph_with_pdl():
    """The LM head's shape with its argmax in a CUDA graph, launched with PDL behind a GEMV whose output is its x:
    every replay, on new inputs, gives torch.argmax of the same chain's logits (the key is 0 again after each)."""
    if missing := pdl_missing_here():
        pytest.skip(f"PDL needs {missing}")
    from minirt.kernels.gemv_triton import linear_gemv

    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(1024, 1024, generator=gen) / 32).to(torch.bfloat16).cuda()
    head = (torch.randn(151936, 1024, generator=gen) / 32).to(torch.bfloat16).cuda()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    key = torch.zeros(1, dtype=torch.int64, device="cuda")

    def step():
        return linear_gemv(linear_gemv(x, w0, pdl=True), head, argmax_key=key, pdl=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token = step()
    seen = set()
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = linear_gemv(linear_gemv(x, w0), head).argmax(dim=-1)
        torch.cuda.synchronize()
        assert torch.equal(token, want) and key.item() == 0
        seen.add(want.item())
    assert len(seen) > 1                                   # the inputs did change the winner


def test_prefetch_chunks_cover_each_span_once_in_order():
    """The arithmetic of `l2_prefetch_table`, on plain numbers: spans whole, half and not a multiple of the chunk."""
    pytest.importorskip("triton")
    from minirt.kernels.gemv_triton import prefetch_chunks

    spans = [(4096, 64), (65536, 48), (1 << 20, 16), (1 << 30, 160)]
    for chunk in (16, 32, 64, 1024):
        chunks = prefetch_chunks(spans, chunk)
        assert len(chunks) == sum(-(-n // chunk) for _, n in spans)
        assert all(0 < size <= chunk for _, size in chunks)
        i = 0
        for address, nbytes in spans:
            covered = 0
            while covered < nbytes:
                assert chunks[i] == (address + covered, min(chunk, nbytes - covered))
                covered += chunks[i][1]
                i += 1
            assert covered == nbytes
        assert i == len(chunks)


def test_l2_prefetch_table_argument_errors():
    pytest.importorskip("triton")
    from minirt.kernels.gemv_triton import l2_prefetch_table

    with pytest.raises(ValueError, match=r"^chunk_bytes: must be a positive multiple of 16, got 24"):
        l2_prefetch_table([torch.zeros(8)], 24)
    with pytest.raises(ValueError, match=r"^tensors: give at least one tensor"):
        l2_prefetch_table([])
    with pytest.raises(ValueError, match=r"^tensors: each must be a contiguous CUDA tensor .* on cpu"):
        l2_prefetch_table([torch.zeros(8)])


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
def test_gemv_l2_prefetch_is_a_hint_and_its_table_covers_the_tensors():
    """The chunks cover each tensor's bytes once, in order, chunk_bytes at a time; a GEMV that asks L2 for them
    (more chunks than programs, or fewer) gives the same bits as one that does not, eagerly and replayed from a
    CUDA graph; a table of the wrong dtype is refused."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.gemv_triton import l2_prefetch_table, linear_gemv

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"the bulk prefetch needs {missing}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    targets = [torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (1024, 3000, 8)]
    for chunk_bytes in (16, 4096, 1 << 20):
        table = l2_prefetch_table(targets, chunk_bytes).tolist()
        assert len(table) == sum(-(-t.nbytes // chunk_bytes) for t in targets)
        covered = {}
        for address, size in table:
            t = next(t for t in targets if t.data_ptr() <= address < t.data_ptr() + t.nbytes)
            assert 0 < size <= chunk_bytes and size % 16 == 0 and address % 16 == 0
            assert address == t.data_ptr() + covered.get(t.data_ptr(), 0)          # in order, no gap or overlap
            covered[t.data_ptr()] = covered.get(t.data_ptr(), 0) + size
        assert covered == {t.data_ptr(): t.nbytes for t in targets}
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) / 32
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    norm_w = torch.rand(1024, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    cases = [(l2_prefetch_table(targets, 4096), {}),                                 # 2,016 chunks, 512 programs
             (l2_prefetch_table(targets, 1 << 20), {"norm_weight": norm_w}),              # 8 chunks
             (l2_prefetch_table(targets[2:]),                                              # 1 chunk, 256 programs
              {"silu_and_mul": True, "norm_weight": norm_w, "residual": x * 2})]
    for table, kwargs in cases:
        ref = linear_gemv(x, w, **kwargs)
        for pdl in (False, True):
            got = linear_gemv(x, w, l2_prefetch=table, pdl=pdl, **kwargs)
            assert all(torch.equal(a, b) for a, b in zip(got if isinstance(got, tuple) else (got,),
                                                         ref if isinstance(ref, tuple) else (ref,)))
    table = cases[0][0]                                     # more chunks than programs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_gemv(x, w, l2_prefetch=table, pdl=True)
    x.copy_(torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, linear_gemv(x, w))
    with pytest.raises(ValueError, match=r"^l2_prefetch: must be a contiguous int64 \[chunks, 2\] table on cuda"):
        linear_gemv(x, w, l2_prefetch=l2_prefetch_table(targets).int())
