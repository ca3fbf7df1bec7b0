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
# Relative to the output's largest magnitude: float32 sums stay near 1e-6; bf16 outputs are rounded to 8 bits,
# float16 ones to 11.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (block_m, block_n, block_k, num_warps) besides the default: tails in N and K, several rows per program.
CONFIGS = [(1, 1, 64, 1), (2, 4, 32, 2), (8, 2, 16, 1), (4, 8, 128, 4)]


def check_quant_gemv(m, k, n, method, block_size, with_bias, dtype, device, config=None, seed=0, lead=None):
    """`check_quant_product` for quant_gemv, with block sizes `config` (None: its choice)."""
    from minirt.kernels.quant_gemv_triton import QuantGemvConfig, quant_gemv

    cfg = QuantGemvConfig(*config) if config else None
    check_quant_product(lambda *args: quant_gemv(*args, config=cfg), m, k, n, method, block_size, with_bias, dtype,
                        device, seed, lead)


def check_quant_product(product, m, k, n, method, block_size, with_bias, dtype, device, seed=0, lead=None):
    """Fresh random weights quantized by `formats.quantize`, fresh x; `product(x, q, scale, block_size, bias)` (a
    kernel with quant_gemv's contract) must match the float64 product of x with the dequantized weight in shape,
    dtype and values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    w[:, 0] *= 8                                        # an outlier channel, so scales differ across blocks
    q, scale = quantize(w, method, block_size)
    x = torch.randn(*(lead or (m,)), k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    ref = x.double() @ dequantize(q, scale, block_size).double().T
    if b is not None:
        ref = ref + b.double()
    out = product(x.to(device), q.to(device), scale.to(device), block_size, None if b is None else b.to(device))
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
    from minirt.kernels.quant_gemv_triton import quant_gemv

    check_in_cuda_graph(quant_gemv, 2, block_size)


def check_in_cuda_graph(product, m, block_size):
    """`product(x, q, scale, block_size)` (quant_gemv's contract) captured once with m rows of x, replayed on new x:
    no host syncs or data-dependent allocations in the call."""
    q, scale = quantize(torch.randn(1024, 3072, device="cuda") / 3072 ** 0.5, "fp8", block_size)
    x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
    product(x, q, scale, block_size)                      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(x, q, scale, block_size)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = x.double() @ dequantize(q, scale, block_size).double().T
        assert (out.double() - ref).abs().max().item() <= TOL[torch.bfloat16] * ref.abs().max().item()


def test_quant_gemv_argument_errors():
    """Each bad argument is named; the checks run before any kernel, so CPU tensors do."""
    pytest.importorskip("triton")
    from minirt.kernels.quant_gemv_triton import quant_gemv

    check_quant_argument_errors(quant_gemv)
    q, scale = quantize(torch.randn(8, 16), "int8")
    x = torch.randn(1, 16)
    with pytest.raises(ValueError, match=r"^q: silu_and_mul needs gate and up rows, an even count, got 7"):
        quant_gemv(x, *quantize(torch.randn(7, 16), "int8"), silu_and_mul=True)
    with pytest.raises(ValueError, match=r"^pdl: programmatic dependent launch needs a CUDA device"):
        quant_gemv(x, q, scale, pdl=True)


def check_quant_argument_errors(product):
    """`product(x, q, scale, block_size, bias)` (a kernel with quant_gemv's contract, `check_quant_args`) names each
    bad argument."""
    q, scale = quantize(torch.randn(8, 16), "int8")
    qb, scale_b = quantize(torch.randn(8, 16), "fp8", 4)
    x = torch.randn(1, 16)
    with pytest.raises(ValueError, match=r"^q: must be \[N, 12\]"):
        product(torch.randn(1, 12), q, scale)
    with pytest.raises(ValueError, match=r"^q: must be int8 or float8_e4m3fn, got torch.float32"):
        product(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"^q: must be contiguous"):
        product(torch.randn(1, 8), q.t(), scale)
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(8,\)"):
        product(x, q, scale[:4])
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(2, 4\) .* block_size=4"):
        product(x, qb, scale, 4)
    with pytest.raises(ValueError, match=r"^scale: must be a contiguous float32 \(8,\)"):
        product(x, q, scale.double())
    with pytest.raises(ValueError, match=r"^block_size: must be an integer >= 1 or None, got 0"):
        product(x, qb, scale_b, 0)
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\] in torch.float32"):
        product(x, q, scale, None, torch.randn(7))
    with pytest.raises(ValueError, match=r"^bias: must be a contiguous \[8\] in torch.float32"):
        product(x, q, scale, None, torch.randn(8, dtype=torch.bfloat16))
    assert product(torch.randn(0, 16), q, scale).shape == (0, 8)      # no rows: no kernel


def check_silu_and_mul(m, k, i, method, block_size, dtype, device, config=None, seed=0, pdl=False):
    """quant_gemv with SiLU-and-multiply in its epilogue against the contract written out here: the float64
    product with the dequantized merged gate/up weight, each half rounded to dtype, then silu(gate) * up."""
    from minirt.kernels.quant_gemv_triton import QuantGemvConfig, quant_gemv

    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize(torch.randn(2 * i, k, generator=gen) / k ** 0.5, method, block_size)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(2 * i, generator=gen).to(dtype)
    y = (x.double() @ dequantize(q, scale, block_size).double().T + b.double()).to(dtype).double()
    ref = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    out = quant_gemv(x.to(device), q.to(device), scale.to(device), block_size, b.to(device), silu_and_mul=True,
                     pdl=pdl, config=QuantGemvConfig(*config) if config else None)
    assert out.shape == (m, i) and out.dtype == dtype
    size = ref.abs().max().item()
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 3 * TOL[dtype] * size, f"max |out - ref| = {err:.3g}, {err / size:.3g} of the output scale"


@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run the kernel on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,i,method,block_size", [(1, 100, 7, "int8", None), (3, 64, 32, "fp8", 16),
                                                     (1, 96, 48, "fp8", 16), (5, 40, 24, "int8", 8)], ids=str)
def test_quant_gemv_silu_and_mul_interpreter(m, k, i, method, block_size, dtype):
    pytest.importorskip("triton")
    check_silu_and_mul(m, k, i, method, block_size, dtype, "cpu")
    check_silu_and_mul(m, k, i, method, block_size, dtype, "cpu", config=(2, 2, 8, 1))


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("block_size", [None, 128], ids=["channel", "block128"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 4])
def test_quant_gemv_silu_and_mul_cuda(m, method, block_size):
    check_silu_and_mul(m, 1024, 3072, method, block_size, torch.bfloat16, "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton kernel)")
@pytest.mark.parametrize("block_size", [None, 128], ids=["channel", "block128"])
def test_quant_gemv_pdl_chain_in_cuda_graph(block_size):
    """A chain of PDL launches (each product's x is the one before's output, with a SiLU-and-multiply epilogue
    between) captured and replayed: every result equals the same chain without PDL, so no kernel read its x
    before it was written."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.quant_gemv_triton import quant_gemv

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    gen = torch.Generator().manual_seed(0)
    layers = [quantize((torch.randn(n, 1024, generator=gen) / 32).cuda(), "fp8", block_size)
              for n in (1024, 2048, 1024, 1024)]
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        h = x
        for i, (q, s) in enumerate(layers):
            h = quant_gemv(h, q, s, block_size, silu_and_mul=i == 1, pdl=pdl)
        return h

    chain(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = chain(False)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


# ------------------------------------------------------------------ the fast module swapped in for QuantizedLinear
def quantized_layer(k, n, method, block_size, bias=True, seed=0):
    from minirt.quant.linear import QuantizedLinear

    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias)
    return QuantizedLinear.from_linear(linear, method, block_size)


def oracle(layer, x):
    """x @ dequantize(weight, weight_scale).T + bias in float64: the contract, from the formats module."""
    y = x.double() @ dequantize(layer.weight, layer.weight_scale, layer.block_size).double().T
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("method,block_size", [("int8", None), ("fp8", None), ("fp8", 32), ("int8", 16)])
def test_fast_quantized_linear_sends_few_rows_to_the_gemv_and_keeps_the_product(method, block_size):
    """Rows up to GEMV_OUTPUTS // out_features go to the GEMV (here its torch contract), more to the many-rows
    product; both give the dequantized product (float32), whatever the leading dims. One row always takes the GEMV."""
    from minirt.fast.quant_layers import GEMV_OUTPUTS, FastQuantizedLinear, dequantize_linear, quant_gemv_reference

    layer = quantized_layer(64, 96, method, block_size)
    calls = []
    fast = FastQuantizedLinear(layer, lambda *a: calls.append("gemv") or quant_gemv_reference(*a),
                               lambda *a: calls.append("many") or dequantize_linear(*a))
    assert fast.weight is layer.weight and fast.weight_scale is layer.weight_scale and fast.bias is layer.bias
    most = GEMV_OUTPUTS // 96
    for lead, path in [((1,), "gemv"), ((1, 1), "gemv"), ((3,), "gemv"), ((2, 4), "gemv"), ((most,), "gemv"),
                       ((most + 1,), "many"), ((1, most + 1), "many")]:
        calls.clear()
        x = torch.randn(*lead, 64)
        out = fast(x)
        assert calls == [path] and out.shape == (*lead, 96) and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), oracle(layer, x), atol=1e-5, rtol=1e-5)
    wide = FastQuantizedLinear(quantized_layer(64, GEMV_OUTPUTS + 16, method, block_size),
                               lambda *a: calls.append("gemv") or quant_gemv_reference(*a),
                               lambda *a: calls.append("many") or dequantize_linear(*a))
    for rows, path in ((1, "gemv"), (2, "many")):              # wider than GEMV_OUTPUTS: one row only
        calls.clear()
        wide(torch.randn(rows, 64))
        assert calls == [path]


def test_scaled_mm_linear_is_the_product_of_the_fp8_rounded_activations():
    """The FP8 tensor-core path quantizes each row of x to e4m3 with its own scale (amax / 448); its result is the
    contract's product taken with those rounded activations (bf16 output), and within the e4m3 rounding of the
    exact one. Runs wherever torch._scaled_mm does (CUDA with FP8, and torch's CPU kernel)."""
    from minirt.fast.quant_layers import quantize_rows_fp8, scaled_mm_linear

    layer = quantized_layer(128, 64, "fp8", None, bias=True)
    layer.bias = torch.nn.Parameter(layer.bias.detach().to(torch.bfloat16), requires_grad=False)
    x = (torch.randn(2, 24, 128) * torch.linspace(0.01, 10, 24)[:, None]).to(torch.bfloat16)   # rows of all sizes
    try:
        out = scaled_mm_linear(x, layer.weight, layer.weight_scale, None, layer.bias)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run here: {e}")
    x_q, x_scale = quantize_rows_fp8(x.reshape(-1, 128))
    assert x_q.dtype == torch.float8_e4m3fn and x_scale.shape == (48, 1)
    assert (x_q.float().abs().amax(dim=1) == 448).all()          # each row's largest element at e4m3's largest value
    rounded = (x_q.double() * x_scale.double()).reshape(2, 24, 128)
    assert out.shape == (2, 24, 64) and out.dtype == torch.bfloat16
    want = oracle(layer, rounded)
    size = want.abs().amax(dim=-1, keepdim=True)
    assert ((out.double() - want).abs() <= 1e-2 * size).all()        # bf16 output: 8 significant bits
    exact = oracle(layer, x)
    assert ((out.double() - exact).abs() <= 0.1 * size).all()        # e4m3 activations: 2^-4 relative each


def test_fast_quantized_picks_the_many_rows_product_by_what_the_device_has():
    from minirt.fast.quant_layers import dequantize_linear, fast_quantized, scaled_mm_missing

    layer = quantized_layer(64, 96, "fp8", None)
    assert scaled_mm_missing(layer) == ["a CUDA device (got cpu)"]
    assert fast_quantized(layer, gemv=print).many_rows is dequantize_linear
    assert "FP8 weights (got int8)" in scaled_mm_missing(quantized_layer(64, 96, "int8", None))
    assert "per-channel scales (got 32 x 32 blocks)" in scaled_mm_missing(quantized_layer(64, 96, "fp8", 32))
    assert "in and out features multiples of 16 (got 64, 90)" in scaled_mm_missing(quantized_layer(64, 90, "fp8", None))


@pytest.mark.parametrize("method,block_size,sizes,merges", [
    ("int8", None, (48, 16, 16), True), ("fp8", 16, (48, 16, 16), True), ("fp8", 16, (48, 16, 8), True),
    ("fp8", 16, (40, 16, 16), False)])
def test_merge_quantized_concatenates_weights_and_scales(method, block_size, sizes, merges):
    """The merged layer's output is the layers' outputs side by side (each its own contract); with block scales a
    layer before the last whose rows are not whole blocks cannot merge (None)."""
    from minirt.fast.quant_layers import merge_quantized

    layers = [quantized_layer(40, n, method, block_size, seed=i) for i, n in enumerate(sizes)]
    merged = merge_quantized(*layers)
    if not merges:
        assert merged is None
        return
    assert merged.out_features == sum(sizes) and merged.method == method and merged.block_size == block_size
    x = torch.randn(5, 40)
    want = torch.cat([oracle(m, x) for m in layers], dim=-1)
    torch.testing.assert_close(oracle(merged, x), want, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(merged(x).double(), want, atol=1e-4, rtol=1e-4)
    assert merge_quantized(layers[0], quantized_layer(40, 16, "int8" if method == "fp8" else "fp8", block_size)) is None


@pytest.mark.parametrize("method,block_size", [("int8", None), ("fp8", 16)])
def test_speed_up_model_swaps_quantized_linears_and_keeps_the_logits(tiny_model_path, method, block_size):
    """A quantized tiny model with the plan's quantized modules (merged q/k/v and gate/up, the GEMV's torch contract
    standing in for the kernel; a float LM head through the float GEMV's contract): every quantized projection is a
    FastQuantizedLinear (per-channel ones inside a QuantizedGemvLinear), one-token steps of three sequences call
    the GEMV for each (counted), and the logits stay the reference quantized model's (float32), for one token and
    for 45."""
    import minirt
    from minirt.fast import Plan
    from minirt.fast.layers import GemvLinear, speed_up_model
    from minirt.fast.ops import ModelKernels, gemv_reference
    from minirt.fast.quant_layers import FastQuantizedLinear, QuantizedGemvLinear, quant_gemv_reference
    from minirt.quant.model import quantize_model
    from conftest import random_prompts
    from test_model import _minirt_logits

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    quantize_model(model, method, block_size)
    ids1, ids9 = torch.tensor(random_prompts(3, [1, 1, 1])), torch.tensor(random_prompts(3, [45, 45, 45]))
    want1, want9 = _minirt_logits(model, ids1), _minirt_logits(model, ids9)
    calls = []
    kernels = ModelKernels(gemv=gemv_reference, quant_gemv=lambda *a, **kw: calls.append((a[1].shape, kw))
                           or quant_gemv_reference(*a, **kw))
    speed_up_model(model, Plan(merge_projections=True, gemv=True, quant_gemv=True, quantization=method,
                               weight_block_size=block_size), kernels)
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if block_size is None:      # one scale per output channel: one-row steps take the float GEMV's contract
            assert isinstance(proj, QuantizedGemvLinear) and isinstance(proj.rows, FastQuantizedLinear)
        else:
            assert isinstance(proj, FastQuantizedLinear)
    assert isinstance(model.lm_head, GemvLinear)
    got1 = _minirt_logits(model, ids1)
    assert len(calls) == 4 * model.config.num_hidden_layers
    assert sum(kw == {"silu_and_mul": True} for _, kw in calls) == model.config.num_hidden_layers   # gate/up's
    torch.testing.assert_close(got1, want1, atol=1e-4 * max(1.0, want1.abs().max().item()), rtol=1e-4)
    calls.clear()
    got9 = _minirt_logits(model, ids9)          # 135 rows: past GEMV_OUTPUTS // 64 (o, down), the many-rows product
    torch.testing.assert_close(got9, want9, atol=1e-4 * max(1.0, want9.abs().max().item()), rtol=1e-4)
    assert not calls


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_channel_one_token_steps_take_the_float_gemv_with_its_norm_prologue(tiny_model_path, method):
    """Per-channel quantized weights under the plan's norm_in_gemv: a batch-1 one-token step runs each merged
    q/k/v and gate/up through the float GEMV's contract with the norm in its prologue and the scales bound
    (`weight_scale`), o and down through it plainly, never quant_gemv; the logits stay the reference quantized
    model's (float32)."""
    import minirt
    from minirt.fast import Plan
    from minirt.fast.layers import NormInGemvLayer, speed_up_model
    from minirt.fast.ops import ModelKernels, gemv_reference
    from minirt.fast.quant_layers import quant_gemv_reference
    from minirt.quant.model import quantize_model
    from conftest import random_prompts
    from test_model import _minirt_logits

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    quantize_model(model, method, None)
    ids = torch.tensor(random_prompts(1, [1]))
    want = _minirt_logits(model, ids)
    row_calls, few_calls = [], []

    def gemv(x, weight, bias=None, **kw):
        row_calls.append((weight.dtype, sorted(kw)))
        return gemv_reference(x, weight, bias, **kw)

    kernels = ModelKernels(gemv=gemv, quant_gemv=lambda *a, **kw: few_calls.append(1) or quant_gemv_reference(*a, **kw))
    speed_up_model(model, Plan(merge_projections=True, gemv=True, quant_gemv=True, norm_in_gemv=True,
                               quantization=method), kernels)
    assert all(isinstance(layer, NormInGemvLayer) for layer in model.model.layers)
    got = _minirt_logits(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    n = model.config.num_hidden_layers
    one_byte = torch.int8 if method == "int8" else torch.float8_e4m3fn
    assert not few_calls
    assert row_calls.count((one_byte, ["eps", "norm_weight", "residual", "weight_scale"])) == n        # q/k/v
    assert row_calls.count((one_byte, ["eps", "norm_weight", "residual", "silu_and_mul", "weight_scale"])) == n
    assert row_calls.count((one_byte, ["weight_scale"])) == 2 * n                                     # o, down


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("method,block_size", [("int8", None), ("fp8", 16)])
def test_one_token_forward_through_quant_gemv_keeps_the_quantized_logits(tiny_model_path, method, block_size):
    """The Triton kernel itself in the model (merged q/k/v, gate/up with SiLU-and-multiply in its epilogue, o and
    down; the float LM head through F.linear): a one-token forward gives the reference quantized model's logits
    (float32), and 45-token ones through quant_gemm too."""
    import minirt
    from conftest import TRITON_DEVICE, random_prompts
    from minirt.fast import Plan
    from minirt.fast.layers import speed_up_model
    from minirt.fast.ops import ModelKernels
    from minirt.kernels.quant_gemv_triton import quant_gemv
    from minirt.quant.model import quantize_model
    from test_model import _minirt_logits

    from minirt.kernels.quant_gemm_triton import quant_gemm

    model, _ = minirt.load_model(tiny_model_path, device=TRITON_DEVICE, dtype=torch.float32)
    quantize_model(model, method, block_size)
    ids, ids9 = torch.tensor(random_prompts(3, [1])), torch.tensor(random_prompts(3, [45, 45, 45]))
    want, want9 = _minirt_logits(model, ids), _minirt_logits(model, ids9)
    speed_up_model(model, Plan(merge_projections=True, quant_gemv=True, quantization=method,
                               weight_block_size=block_size), ModelKernels(quant_gemv=quant_gemv, quant_gemm=quant_gemm))
    got = _minirt_logits(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    got9 = _minirt_logits(model, ids9)          # 135 rows: past GEMV_OUTPUTS // 64, through quant_gemm
    torch.testing.assert_close(got9, want9, atol=1e-4 * max(1.0, want9.abs().max().item()), rtol=1e-4)
