"""`quant_gemm` (the Triton matrix product over int8 / FP8 weights and their scales, on the matrix units) against its
contract, quant_gemv's: `x.float() @ dequantize(q, scale, block_size).T (+ bias)` with
`minirt.quant.formats.dequantize`, in float64 (`check_quant_product`).

The kernel cases need CUDA, or Triton's interpreter (`TRITON_INTERPRET=1`; small shapes only, it is slow). The
interpreter multiplies bfloat16 `tl.dot` operands as their raw bits (triton-lang/triton#11584, not supported), so
on the CPU float16 x stands in for bfloat16: the same path, weights converted to a 16-bit dtype and multiplied in
it; the CUDA cases check bfloat16. The argument checks need Triton importable, nothing else.
"""

from __future__ import annotations

import pytest
import torch

from minirt.quant.formats import quantize
from test_quant_gemv import (CUDA, CUDA_SHAPES, INTERPRET, check_in_cuda_graph, check_quant_argument_errors,
                             check_quant_product)

# (m, k, n, block_size): one row to a few tiles of them; per channel and per block, edge blocks partial in N and K;
# B = 48 (16, the largest power of two dividing it, per step) and B = 24 (no step of 16 fits: scaled weight tiles).
INTERPRETER_CASES = [(1, 100, 7, None), (17, 256, 64, None), (3, 300, 70, 128), (40, 96, 40, 32), (17, 200, 33, 48),
                     (3, 72, 33, 24), (5, 64, 20, 16)]
# (block_m, block_n, block_k, num_warps, num_stages) besides the choice: tails in M, N and K; with B = 48, steps of
# 16 (one block column each) and of 32, 64, 128 (scaled weight tiles).
CONFIGS = [(16, 16, 16, 1, 1), (16, 32, 64, 2, 2), (32, 16, 32, 4, 3), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3)]


def check_quant_gemm(m, k, n, method, block_size, with_bias, dtype, device, config=None, lead=None):
    """`check_quant_product` for quant_gemm, with block sizes `config` (None: its choice)."""
    from minirt.kernels.quant_gemm_triton import QuantGemmConfig, quant_gemm

    cfg = QuantGemmConfig(*config) if config else None
    check_quant_product(lambda *args: quant_gemm(*args, config=cfg), m, k, n, method, block_size, with_bias, dtype,
                        device, lead=lead)


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n,block_size", INTERPRETER_CASES, ids=str)
def test_quant_gemm_matches_dequantized_product_interpreter(m, k, n, block_size, method, dtype):
    pytest.importorskip("triton")
    check_quant_gemm(m, k, n, method, block_size, m % 2 == 1, dtype, "cpu")


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("block_size", [None, 32, 48], ids=["channel", "block32", "block48"])
def test_quant_gemm_configs_interpreter(config, block_size):
    pytest.importorskip("triton")
    check_quant_gemm(40, 200, 45, "fp8", block_size, False, torch.float32, "cpu", config)
    check_quant_gemm(None, 200, 45, "int8", block_size, True, torch.float32, "cpu", config, lead=(2, 3))


def test_quant_gemm_choose_config_follows_the_table():
    """By rows: the TILES row whose count holds m; block sizes cut to small n and k; with block scales, steps of the
    largest power of two dividing B when that is 16 or more (else the TILES step: scaled weight tiles)."""
    pytest.importorskip("triton")
    from minirt.kernels.quant_gemm_triton import QuantGemmConfig, choose_config

    assert choose_config(1, 4096, 1024, None) == QuantGemmConfig(16, 64, 128, 4, 4)
    assert choose_config(17, 4096, 1024, None) == QuantGemmConfig(32, 64, 128, 4, 4)
    assert choose_config(64, 4096, 1024, 128) == QuantGemmConfig(64, 64, 128, 4, 3)
    assert choose_config(65, 4096, 1024, 128) == QuantGemmConfig(128, 128, 64, 8, 3)
    assert choose_config(8192, 4096, 1024, 48) == QuantGemmConfig(128, 128, 16, 8, 3)
    assert choose_config(1, 4096, 1024, 24) == QuantGemmConfig(16, 64, 128, 4, 4)
    assert choose_config(100, 7, 20, None) == QuantGemmConfig(128, 16, 32, 8, 3)


def test_quant_gemm_argument_errors():
    """Each bad argument is named (the checks quant_gemv shares, then x's dtype and the config); they run before any
    kernel, so CPU tensors do."""
    pytest.importorskip("triton")
    from minirt.kernels.quant_gemm_triton import QuantGemmConfig, quant_gemm

    check_quant_argument_errors(quant_gemm)
    q, scale = quantize(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match=r"^x: must be float32, bfloat16 or float16, got torch.float64"):
        quant_gemm(torch.randn(1, 16, dtype=torch.float64), q, scale)
    with pytest.raises(ValueError, match=r"^config: block_m, block_n, block_k must be powers of two >= 16"):
        quant_gemm(torch.randn(1, 16), q, scale, config=QuantGemmConfig(16, 8, 16))
    with pytest.raises(ValueError, match=r"^config: block_m, block_n, block_k must be powers of two >= 16"):
        quant_gemm(torch.randn(1, 16), q, scale, config=QuantGemmConfig(16, 16, 48))



@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,block_size", [("int8", None), ("fp8", None), ("int8", 128), ("fp8", 128), ("fp8", 48)],
                         ids=str)
def test_quant_gemm_matches_dequantized_product_cuda(method, block_size, dtype):
    """Each of quant_gemv's CUDA shapes at one row, one tile of rows, a tail of rows and many tiles."""
    for k, n in CUDA_SHAPES:
        for m in (1, 16, 33, 300):
            check_quant_gemm(m, k, n, method, block_size, n % 2 == 1, dtype, "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("config", [None, *CONFIGS], ids=str)
def test_quant_gemm_configs_cuda_and_in_cuda_graph(config):
    """Each config (None: the choice) with tails in M, N and K, then captured in a CUDA graph and replayed."""
    from minirt.kernels.quant_gemm_triton import QuantGemmConfig, quant_gemm

    check_quant_gemm(300, 1000, 333, "fp8", 128, True, torch.bfloat16, "cuda", config)
    check_quant_gemm(40, 1000, 333, "int8", None, True, torch.bfloat16, "cuda", config)
    cfg = QuantGemmConfig(*config) if config else None
    check_in_cuda_graph(lambda *args: quant_gemm(*args, config=cfg), 64, 128)
