"""`quant_gemv` (the Triton matrix-vector product over int8 / FP8 weights and their scales) against its contract:
`x.float() @ dequantize(q, scale, block_size).T (+ bias)` with `minirt.quant.formats.dequantize`, in float64.

The kernel cases need CUDA, or Triton's interpreter (`TRITON_INTERPRET=1`, which runs the kernel on CPU tensors;
small shapes only, it is slow). The argument checks need Triton importable, nothing else.
"""

from __future__ import annotations

import os

import pytest
import torch

from minirt.quant.formats import dequantize, quantize

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Relative to the output's largest magnitude: float32 sums stay near 1e-6; bf16 outputs are rounded to 8 bits.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (block_m, block_n, block_k, num_warps) besides the default: tails in N and K, several rows per program.
CONFIGS = [(1, 1, 64, 1), (2, 4, 32, 2), (8, 2, 16, 1), (4, 8, 128, 4)]


def check_quant_gemv(m, k, n, method, block_size, with_bias, dtype, device, config=None, seed=0, lead=None):
    """Fresh random weights quantized by `formats.quantize`, fresh x; quant_gemv's output must match the float64
    product of x with the dequantized weight in shape, dtype and values."""
    from minirt.kernels.quant_gemv_triton import QuantGemvConfig, quant_gemv

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    w[:, 0] *= 8                                        # an outlier channel, so scales differ across blocks
    q, scale = quantize(w, method, block_size)
    x = torch.randn(*(lead or (m,)), k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    ref = x.double() @ dequantize(q, scale, block_size).double().T
    if b is not None:
        ref = ref + b.double()
    out = quant_gemv(x.to(device), q.to(device), scale.to(device), block_size,
                     None if b is None else b.to(device), config=QuantGemvConfig(*config) if config else None)
    assert out.shape == ref.shape and out.dtype == dtype and out.device.type == torch.device(device).type
    size = ref.abs().max().item()
    err = (out.double().cpu() - ref).abs().max().item()      # NaN (an unwritten output) fails the comparison
    assert err <= TOL[dtype] * size, f"max |out - ref| = {err:.3g}, {err / size:.3g} of the output scale"


# (m, k, n, block_size): one and few rows, per channel and per block, edge blocks partial in N and K.
INTERPRETER_CASES = [(1, 100, 7, None), (3, 256, 64, None), (1, 256, 64, 128), (2, 300, 70, 128), (5, 96, 40, 32),
                     (1, 72, 33, 24), (8, 64, 20, 16)]


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n,block_size", INTERPRETER_CASES, ids=str)
def test_quant_gemv_matches_dequantized_product_interpreter(m, k, n, block_size, method, dtype):
    pytest.importorskip("triton")
    check_quant_gemv(m, k, n, method, block_size, True, dtype, "cpu")


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("block_size", [None, 32], ids=["channel", "block32"])
def test_quant_gemv_configs_interpreter(config, block_size):
    pytest.importorskip("triton")
    check_quant_gemv(3, 200, 45, "fp8", block_size, False, torch.float32, "cpu", config)
    check_quant_gemv(1, 200, 45, "int8", block_size, True, torch.float32, "cpu", config, lead=(1, 1))


# The Qwen3-0.6B projections (merged q/k/v, o, merged gate/up, down) and a vocabulary-sized one.
CUDA_SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (100, 7), (1000, 333)]   # (K, N)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [None, 128], ids=["channel", "block128"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("k,n", CUDA_SHAPES, ids=[f"K{k}-N{n}" for k, n in CUDA_SHAPES])
def test_quant_gemv_matches_dequantized_product_cuda(k, n, m, method, block_size, dtype):
    check_quant_gemv(m, k, n, method, block_size, n % 2 == 1, dtype, "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_quant_gemv_configs_cuda(config):
    check_quant_gemv(3, 1000, 333, "fp8", 128, True, torch.bfloat16, "cuda", config)
    check_quant_gemv(1, 1000, 333, "int8", None, True, torch.bfloat16, "cuda", config)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("block_size", [None, 128], ids=["channel", "block128"])
def test_quant_gemv_in_cuda_graph(block_size):
    """Captured once, replayed on new x: no host syncs or data-dependent allocations in the call."""
    from minirt.kernels.quant_gemv_triton import quant_gemv

    q, scale = quantize(torch.randn(1024, 3072, device="cuda") / 3072 ** 0.5, "fp8", block_size)
    x = torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16)
    quant_gemv(x, q, scale, block_size)                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_gemv(x, q, scale, block_size)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = x.double() @ dequantize(q, scale, block_size).double().T
        assert (out.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()


def test_quant_gemv_argument_errors():
    """Each bad argument is named; the checks run before any kernel, so CPU tensors do."""
    pytest.importorskip("triton")
    from minirt.kernels.quant_gemv_triton import quant_gemv

    q, scale = quantize(torch.randn(8, 16), "int8")
    qb, scale_b = quantize(torch.randn(8, 16), "fp8", 4)
    x = torch.randn(1, 16)
    with pytest.raises(ValueError, match=r"^q: must be \[N, 12\]"):
        quant_gemv(torch.randn(1, 12), q, scale)
    with pytest.raises(ValueError, match=r"^q: must be int8 or float8_e4m3fn, got torch.float32"):
        quant_gemv(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"^q: must be contiguous"):
        quant_gemv(torch.randn(1, 8), q.t(), scale)
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(8,\)"):
        quant_gemv(x, q, scale[:4])
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(2, 4\) .* block_size=4"):
        quant_gemv(x, qb, scale, 4)
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(8,\)"):
        quant_gemv(x, q, scale.double())
    with pytest.raises(ValueError, match=r"^block_size: must be an integer >= 1 or None, got 0"):
        quant_gemv(x, qb, scale_b, 0)
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\] in torch.float32"):
        quant_gemv(x, q, scale, None, torch.randn(7))
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\] in torch.float32"):
        quant_gemv(x, q, scale, None, torch.randn(8, dtype=torch.bfloat16))
    assert quant_gemv(torch.randn(0, 16), q, scale).shape == (0, 8)      # no rows: no kernel
