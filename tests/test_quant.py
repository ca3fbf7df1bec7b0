"""Chapter 10's reference quantization (`minirt.quant`): formats, `QuantizedLinear`, `quantize_model`, FP8 checkpoints.

Oracles: loops over each scale's group written out here (amax, scale, rounding to the nearest int8 or to the nearest
of the 254 finite e4m3 values, ties to even: not torch's cast), the error bounds of each format, `x @ W.T` with the
dequantized weight, module names enumerated from the model config, and `transformers`: greedy tokens of its
`generate` on a float checkpoint holding the dequantized weights (and, where accelerate is installed, transformers
loading our FP8 checkpoints itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import minirt
from conftest import build_tiny_checkpoint, hf_greedy, random_prompts
from minirt.config import EngineConfig
from minirt.fast import Hardware, resolve_plan
from minirt.model.loader import load_config
from minirt.quant import (QMAX, QuantizedLinear, dequantize, load_fp8_checkpoint, quantize, quantize_model,
                          quantized_modules, save_fp8_checkpoint)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
HOPPER = Hardware("cuda", (), (), (), ())
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# the independent oracles
# ---------------------------------------------------------------------------------------------------------------

def groups(shape, block_size):
    """(index into the scales, slice of rows, slice of columns) of each scale's group, by plain loops."""
    n, k = shape
    if block_size is None:
        return [((i,), slice(i, i + 1), slice(0, k)) for i in range(n)]
    return [((i // block_size, j // block_size), slice(i, i + block_size), slice(j, j + block_size))
            for i in range(0, n, block_size) for j in range(0, k, block_size)]


E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
E4M3_VALUES = E4M3.float()
E4M3_FINITE = ~torch.isnan(E4M3_VALUES)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Each element of `x` (float32, |x| <= 448) to the nearest finite e4m3 value, ties to the even code
    (mantissa bit 0), by search over the table of all 256 codes."""
    grid, codes = E4M3_VALUES[E4M3_FINITE], torch.arange(256)[E4M3_FINITE]
    dist = (x.reshape(-1, 1) - grid).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    even = tied & (codes % 2 == 0)
    pick = torch.where(even.any(dim=1, keepdim=True), even, tied).float().argmax(dim=1)
    out = grid[pick].reshape(x.shape)
    return torch.where(x == 0, torch.zeros_like(x), out)      # +0 and -0: both zero


def oracle_quantize(w: torch.Tensor, method: str, block_size):
    """(q as float32, scale) group by group."""
    rows, cols = -(w.shape[0] // -(block_size or 1)), -(w.shape[1] // -(block_size or w.shape[1]))
    scale = torch.zeros(w.shape[0] if block_size is None else (rows, cols))
    q = torch.zeros_like(w)
    for index, r, c in groups(w.shape, block_size):
        g = w[r, c]
        amax = g.abs().max()
        s = amax / QMAX[method] if amax > 0 else None
        scale[index] = s if s is not None else float("nan")
        if s is None:
            continue
        x = g / s
        q[r, c] = x.round().clamp(-127, 127) if method == "int8" else round_to_e4m3(x.clamp(-448, 448))
    return q, scale


def oracle_dequantize(q: torch.Tensor, scale: torch.Tensor, block_size) -> torch.Tensor:
    if scale.dim() == 0:                                           # one scale per tensor
        return q.float() * scale
    w = torch.empty(q.shape)
    for index, r, c in groups(tuple(q.shape), block_size):
        w[r, c] = q[r, c].float() * scale[index]
    return w


def weight(n=37, k=50, seed=0):
    """A weight with outliers, a zero row and an all-zero 16 x 16 block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    w[3] = 0.0
    w[16:32, 16:32] = 0.0
    return w


CASES = [(m, b) for m in ("int8", "fp8") for b in (None, 16, 5, 64)]     # 5: partial edge blocks; 64: one block


# ---------------------------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,block_size", CASES)
def test_quantize_equals_a_loop_over_the_groups(method, block_size):
    w = weight()
    q, scale = quantize(w, method, block_size)
    want_q, want_scale = oracle_quantize(w, method, block_size)
    assert q.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn) and scale.dtype == torch.float32
    assert scale.shape == want_scale.shape
    nonzero = ~torch.isnan(want_scale)
    assert torch.equal(scale[nonzero], want_scale[nonzero])
    assert torch.isfinite(scale).all() and (scale > 0).all()              # zero groups: a scale, not 0 or NaN
    assert torch.equal(q.float(), want_q)
    assert torch.equal(dequantize(q, scale, block_size), oracle_dequantize(q, scale, block_size))


@pytest.mark.parametrize("method,block_size", CASES)
def test_the_error_is_within_the_formats_bound(method, block_size):
    w = weight(seed=1)
    q, scale = quantize(w, method, block_size)
    deq = dequantize(q, scale, block_size)
    per_element = oracle_dequantize(torch.ones_like(w).to(q.dtype), scale, block_size)     # each element's scale
    err = (w - deq).abs()
    if method == "int8":                         # a uniform grid of step `scale`: at most half a step
        assert (err <= per_element / 2 * (1 + 1e-6)).all()
    else:                                        # 3 mantissa bits: 2^-4 relative for normals, 2^-10 scale below
        normal = (w / per_element).abs() >= 2.0 ** -6
        assert (err[normal] <= w.abs()[normal] * 2.0 ** -4 * (1 + 1e-6)).all()
        assert (err[~normal] <= per_element[~normal] * 2.0 ** -10 * (1 + 1e-6)).all()
    assert torch.equal(deq[3], torch.zeros(w.shape[1])) and torch.equal(deq[16:32, 16:32], torch.zeros(16, 16))
    assert (q.float().abs().amax() == QMAX[method])       # the largest element of a group lands on QMAX


def test_dequantize_refuses_scales_of_the_wrong_shape():
    q, scale = quantize(weight(), "fp8", 16)
    with pytest.raises(ValueError, match=r"^weight_scale: expected shape \(3, 4\) .* weight_block_size=16, got \(37,\)"):
        dequantize(q, torch.ones(37), 16)
    with pytest.raises(ValueError, match=r"^weight_scale: "):
        QuantizedLinear.from_quantized(q, scale, None)


# ---------------------------------------------------------------------------------------------------------------
# QuantizedLinear
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,block_size", [("int8", None), ("fp8", 16), ("int8", 5)])
def test_quantized_linear_equals_x_times_the_dequantized_weight(method, block_size):
    torch.manual_seed(0)
    linear = nn.Linear(50, 37, bias=False)
    layer = QuantizedLinear.from_linear(linear, method, block_size)
    w = oracle_dequantize(layer.weight, layer.weight_scale, block_size)
    assert not torch.equal(w, linear.weight)                  # quantized: the weight moved
    for x in (torch.randn(1, 50), torch.randn(7, 50)):
        assert torch.equal(layer(x), x @ w.T)
    x = torch.randn(2, 3, 50)
    assert torch.allclose(layer(x), x @ w.T, rtol=0, atol=1e-6)
    xb = x.to(torch.bfloat16)
    assert layer(xb).dtype == torch.bfloat16 and torch.equal(layer(xb), xb @ w.to(torch.bfloat16).T)


def test_quantized_linear_keeps_the_bias_and_stores_its_tensors_as_buffers():
    torch.manual_seed(0)
    linear = nn.Linear(50, 37, bias=True)
    layer = QuantizedLinear.from_linear(linear, "fp8", 16)
    assert layer.bias is linear.bias
    x = torch.randn(4, 50)
    assert torch.allclose(layer(x), x @ layer.dequantized().T + linear.bias, rtol=0, atol=1e-6)
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias"} and [n for n, _ in layer.named_parameters()] == ["bias"]
    assert state["weight"].dtype == torch.float8_e4m3fn and state["weight_scale"].shape == (3, 4)
    assert (layer.in_features, layer.out_features, layer.method, layer.block_size) == (50, 37, "fp8", 16)


# ---------------------------------------------------------------------------------------------------------------
# quantize_model
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_quantize_model_swaps_exactly_the_decoder_linears(tiny_models, family):
    model, _ = minirt.load_model(tiny_models[family], device="cpu")
    before = {name: p.clone() for name, p in model.named_parameters()}
    names = quantize_model(model, "int8", 16)
    want = [f"model.layers.{i}.{p}" for i in range(model.config.num_hidden_layers) for p in LINEARS]
    assert names == want and sorted(quantized_modules(model)) == sorted(want)
    assert not any(isinstance(m, nn.Linear) for n, m in model.named_modules() if n != "lm_head")
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    for name, p in model.named_parameters():             # embeddings, norms, LM head, biases: untouched
        assert torch.equal(p, before[name]), name
    for name in want:
        layer = model.get_submodule(name)
        assert layer.weight.dtype == torch.int8 and layer.block_size == 16
        assert (layer.dequantized() - before[f"{name}.weight"]).abs().max() <= layer.weight_scale.max() / 2 * 1.0001


def test_quantize_model_refuses_before_swapping_anything(tiny_models):
    model, _ = minirt.load_model(tiny_models["llama"], device="cpu")
    with pytest.raises(ValueError, match=r"^quantization: must be one of \('int8', 'fp8'\), got 'int4'"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match=r"^weight_block_size: must be an integer >= 1 or None, got 0"):
        quantize_model(model, "fp8", 0)
    assert not quantized_modules(model)


# ---------------------------------------------------------------------------------------------------------------
# greedy tokens against transformers on the dequantized weights
# ---------------------------------------------------------------------------------------------------------------

def save_float_checkpoint(src, dst, weights: dict[str, torch.Tensor]):
    """`src` loaded by transformers in float32, the given weights (name -> float tensor) put in, saved to `dst`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)
    model.save_pretrained(dst, safe_serialization=True)
    return str(dst)


PROMPTS = random_prompts(7, [5, 12, 3])


def assert_greedy_equals(llm, oracle_path, float_path, n=10):
    """minirt's greedy tokens equal transformers' on `oracle_path`, and for some prompt they are not the float
    model's (`float_path`): the test sees whether the quantized weights ran."""
    outs = llm.generate(PROMPTS, minirt.SamplingParams(max_new_tokens=n))      # one batch: rows mixed
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(oracle_path, prompt, n)
    assert any(hf_greedy(oracle_path, p, n) != hf_greedy(float_path, p, n) for p in PROMPTS)


@pytest.mark.parametrize("family,method,block_size", [("qwen3", "int8", None), ("qwen3", "fp8", None),
                                                      ("qwen3", "int8", 16), ("qwen2", "fp8", 16),
                                                      ("llama", "fp8", 5)])
def test_quantized_at_load_greedy_equals_transformers_on_the_dequantized_weights(tiny_models, tmp_path, family,
                                                                                 method, block_size):
    src = tiny_models[family]
    llm = minirt.LLM(src, device="cpu", quantization=method, weight_block_size=block_size)
    plan = llm.engine.plan
    assert (plan.quantization, plan.weight_block_size) == (method, block_size)
    layers = quantized_modules(llm.engine.model)
    assert len(layers) == 7 * llm.engine.model.config.num_hidden_layers
    weights = {f"{name}.weight": oracle_dequantize(m.weight, m.weight_scale, block_size) for name, m in layers.items()}
    float_model, _ = minirt.load_model(src, device="cpu")
    moved = [name for name, w in weights.items() if not torch.equal(w, float_model.get_parameter(name))]
    assert len(moved) == len(weights)                                          # every weight was rounded
    assert_greedy_equals(llm, save_float_checkpoint(src, tmp_path / "dequantized", weights), src)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face FP8 checkpoints
# ---------------------------------------------------------------------------------------------------------------

def fp8_checkpoint(tiny_models, tmp_path, family="qwen3", block_size=16, name="fp8"):
    return save_fp8_checkpoint(tiny_models[family], tmp_path / name, block_size)


def dequantized_checkpoint(fp8_dir, tmp_path, block_size):
    """The float checkpoint an FP8 one stands for: its files read with safetensors, each quantized weight
    dequantized by the loop oracle, the config without its quantization_config."""
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    floats = {name: oracle_dequantize(t, tensors[name.removesuffix(".weight") + ".weight_scale_inv"], block_size)
              if t.dtype == torch.float8_e4m3fn else t
              for name, t in tensors.items() if not name.endswith(".weight_scale_inv")}
    dst = tmp_path / "dequantized"
    dst.mkdir()
    save_file(floats, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    shutil.copy(fp8_dir / "generation_config.json", dst / "generation_config.json")
    return str(dst)


@pytest.mark.parametrize("family,block_size", [("qwen3", 16), ("qwen2", None), ("llama", 128)])
def test_the_writer_writes_the_hugging_face_fp8_format(tiny_models, tmp_path, family, block_size):
    dst = fp8_checkpoint(tiny_models, tmp_path, family, block_size)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [block_size, block_size] if block_size else None,
                                             "modules_to_not_convert": ["lm_head"]}
    tensors = load_file(str(dst / "model.safetensors"))
    source = load_file(str(Path(tiny_models[family]) / "model.safetensors"))
    num_layers = config["num_hidden_layers"]
    quantized = {f"model.layers.{i}.{p}.weight" for i in range(num_layers) for p in LINEARS}
    assert {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn} == quantized
    for name in quantized:
        w, s = tensors[name], tensors[name.removesuffix(".weight") + ".weight_scale_inv"]
        n, k = w.shape
        want = () if block_size is None else (-(n // -block_size), -(k // -block_size))
        assert s.dtype == torch.float32 and tuple(s.shape) == want
        err = (oracle_dequantize(w, s, block_size) - source[name]).abs()
        assert (err <= source[name].abs() * 2.0 ** -4 + s.max() * 2.0 ** -9).all()
    assert set(tensors) == set(source) | {n.removesuffix(".weight") + ".weight_scale_inv" for n in quantized}
    for name in set(source) - quantized:
        assert torch.equal(tensors[name], source[name])


@pytest.mark.parametrize("family,block_size", [("qwen3", 16), ("qwen2", None), ("llama", 128)])
def test_an_fp8_checkpoint_loads_by_its_config_and_equals_transformers_dequantized(tiny_models, tmp_path, family,
                                                                                   block_size):
    dst = fp8_checkpoint(tiny_models, tmp_path, family, block_size)
    llm = minirt.LLM(str(dst), device="cpu")                  # no setting: the checkpoint's config says fp8
    assert (llm.engine.plan.quantization, llm.engine.plan.weight_block_size) == ("fp8", block_size)
    layers = quantized_modules(llm.engine.model)
    assert len(layers) == 7 * llm.engine.model.config.num_hidden_layers
    assert all(m.method == "fp8" and m.weight.dtype == torch.float8_e4m3fn for m in layers.values())
    tensors = load_file(str(dst / "model.safetensors"))
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(), oracle_dequantize(tensors[f"{name}.weight"],
                                                                  tensors[f"{name}.weight_scale_inv"], block_size))
    assert_greedy_equals(llm, dequantized_checkpoint(dst, tmp_path, block_size), tiny_models[family])


def test_transformers_reads_our_fp8_checkpoints_as_we_do(tiny_models, tmp_path):
    """transformers' own FineGrainedFP8 loader (it dequantizes where there is no GPU) reads the writer's files into
    the same weights as `load_fp8_checkpoint`, and generates the same greedy tokens."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")
    from transformers import AutoModelForCausalLM

    for block_size in (16, None):
        dst = fp8_checkpoint(tiny_models, tmp_path, "qwen2", block_size, name=f"fp8-{block_size}")
        hf = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
        model, _ = load_fp8_checkpoint(dst, device="cpu")
        for name, layer in quantized_modules(model).items():
            assert torch.equal(hf.get_submodule(name).weight.float(), layer.dequantized())
        assert_greedy_equals(minirt.LLM(str(dst), device="cpu"), str(dst), tiny_models["qwen2"])


def test_vllms_name_of_a_per_tensor_scale_is_read_too(tiny_models, tmp_path):
    """vLLM's per-tensor FP8 checkpoints call the scale `weight_scale`: the same layers, the same weights."""
    dst = fp8_checkpoint(tiny_models, tmp_path, "qwen2", None)
    want = {n: m.dequantized() for n, m in quantized_modules(load_fp8_checkpoint(dst, device="cpu")[0]).items()}
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {n.removesuffix("_inv"): t for n, t in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"))
    got = {n: m.dequantized() for n, m in quantized_modules(load_fp8_checkpoint(dst, device="cpu")[0]).items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    edit_quantization_config(dst, weight_block_size=[16, 16])      # block scales are weight_scale_inv only
    with pytest.raises(ValueError, match=r"^weights: .*weight_scale"):    # a weight with no scale, or a stray one
        load_fp8_checkpoint(dst, device="cpu")


def test_a_per_channel_scale_loads_where_the_config_has_no_block_size(tiny_models, tmp_path):
    """With weight_block_size null a layer's scale may also be one per output channel, `[N]` or `[N, 1]`."""
    dst = fp8_checkpoint(tiny_models, tmp_path, "llama", None)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    tensors[f"{name}.weight"], scale = quantize(load_file(str(Path(tiny_models["llama"]) / "model.safetensors"))
                                                [f"{name}.weight"], "fp8", None)
    for shape in ((-1,), (-1, 1)):
        tensors[f"{name}.weight_scale_inv"] = scale.reshape(shape)
        save_file(tensors, str(dst / "model.safetensors"))
        layer = load_fp8_checkpoint(dst, device="cpu")[0].get_submodule(name)
        want = tensors[f"{name}.weight"].float() * scale[:, None]
        assert torch.equal(layer.dequantized(), want)
    tensors[f"{name}.weight_scale_inv"] = scale[:5]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^weights: '{name}.weight_scale_inv' has shape \(5,\); with "
                                         r"weight_block_size null a scale is one per tensor"):
        load_fp8_checkpoint(dst, device="cpu")


def test_a_quantized_lm_head_is_dequantized_into_the_float_head(tiny_models, tmp_path):
    """A checkpoint that stores its LM head in FP8 too (no modules_to_not_convert): the head stays an nn.Linear
    here, holding the dequantized weight."""
    dst = fp8_checkpoint(tiny_models, tmp_path, "llama", 16)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"] = quantize(tensors["lm_head.weight"], "fp8", 16)
    save_file(tensors, str(dst / "model.safetensors"))
    model, _ = load_fp8_checkpoint(dst, device="cpu")
    assert type(model.lm_head) is nn.Linear
    assert torch.equal(model.lm_head.weight, oracle_dequantize(tensors["lm_head.weight"],
                                                               tensors["lm_head.weight_scale_inv"], 16))


def test_the_reference_loader_names_the_quantization_config(tiny_models, tmp_path):
    dst = fp8_checkpoint(tiny_models, tmp_path)
    with pytest.raises(ValueError, match=r"^model: .* is pre-quantized \(its config.json has a quantization_config\)"
                                         r".*minirt.LLM or minirt.quant"):
        minirt.load_model(dst)
    with pytest.raises(ValueError, match=r"^model: .* has no quantization_config"):
        load_fp8_checkpoint(tiny_models["llama"])


# ---------------------------------------------------------------------------------------------------------------
# refusals, by name
# ---------------------------------------------------------------------------------------------------------------

def edit_quantization_config(dst, **changes):
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes,words", [
    ({"quant_method": "gptq"}, r"quantization_config.quant_method: 'gptq' is not supported"),
    ({"activation_scheme": "static"}, r"quantization_config.activation_scheme: only 'dynamic' is supported"),
    ({"weight_block_size": [128, 64]}, r"quantization_config.weight_block_size: expected \[B, B\]"),
])
def test_a_checkpoint_minirt_cannot_read_is_refused_by_name(tiny_models, tmp_path, monkeypatch, changes, words):
    dst = edit_quantization_config(fp8_checkpoint(tiny_models, tmp_path), **changes)
    monkeypatch.setattr(minirt.engine, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    with pytest.raises(ValueError, match="^" + words):
        minirt.LLM(str(dst), device="cpu")
    with pytest.raises(ValueError, match="^" + words):
        load_fp8_checkpoint(dst)


@pytest.mark.parametrize("settings,words", [
    (dict(quantization="int8"), r"quantization: 'int8' asked, but the checkpoint's weights are already fp8"),
    (dict(weight_block_size=32), r"weight_block_size: 32 disagrees with the checkpoint's "
                                 r"quantization_config.weight_block_size \(16 x 16 blocks"),
    (dict(quantization="fp8", weight_block_size=128), r"weight_block_size: 128 disagrees"),
])
def test_settings_that_contradict_an_fp8_checkpoint_are_refused_by_name(tiny_models, tmp_path, settings, words):
    config = load_config(fp8_checkpoint(tiny_models, tmp_path))
    with pytest.raises(ValueError, match="^" + words):
        resolve_plan(EngineConfig(**settings), CPU, config)
    plan = resolve_plan(EngineConfig(quantization="fp8", weight_block_size=16), CPU, config)     # agreeing: fine
    assert (plan.quantization, plan.weight_block_size) == ("fp8", 16)


def test_settings_refused_on_a_float_checkpoint(tiny_models, monkeypatch):
    monkeypatch.setattr(minirt.engine, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    with pytest.raises(ValueError, match=r"^weight_block_size: 16 set, but quantization is None"):
        minirt.LLM(tiny_models["llama"], device="cpu", weight_block_size=16)
    with pytest.raises(ValueError, match=r"^quantization: quantized weights need tensor_parallel_size=1 \(got 2"):
        minirt.LLM(tiny_models["llama"], device="cpu", quantization="int8", tensor_parallel_size=2)


def test_an_fp8_checkpoint_under_tensor_parallelism_is_refused(tiny_models, tmp_path):
    config = load_config(fp8_checkpoint(tiny_models, tmp_path))
    with pytest.raises(ValueError, match=r"^quantization: quantized weights need tensor_parallel_size=1 \(got 2"):
        resolve_plan(EngineConfig(tensor_parallel_size=2), CPU, config)


def test_a_scale_of_the_wrong_shape_or_a_float_weight_with_a_scale_is_refused(tiny_models, tmp_path):
    dst = fp8_checkpoint(tiny_models, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    good = tensors[name]
    tensors[name] = torch.ones(good.shape[0] + 1, good.shape[1])
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^weight_scale: expected shape \(4, 8\) for a \(64, 128\) weight with "
                                         r"weight_block_size=16, got \(5, 8\)"):
        minirt.LLM(str(dst), device="cpu")
    tensors[name] = good
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].float()
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^weights: 'model.layers.0.mlp.up_proj.weight' has a weight_scale_inv, so "
                                         r"it must be float8_e4m3fn, got torch.float32"):
        load_fp8_checkpoint(dst)


@pytest.mark.parametrize("switch", ["norm_in_gemv", "l2_prefetch"])
def test_the_float_gemv_chain_switches_are_refused_under_block_scales(switch):
    """The norm prologue and the L2 prefetch chain are built on the float GEMV of the merged projections, which
    applies one scale per output channel: block-scaled layers run quant_gemv instead, and the chain is refused."""
    with pytest.raises(ValueError, match=rf"^{switch}: .* needs float weights or one scale per output channel "
                                         rf"\(got 128 x 128 scale blocks\)$"):
        resolve_plan(EngineConfig(quantization="int8", weight_block_size=128, **{switch: True}),
                     torch.device("cuda"), hardware=HOPPER)
    with pytest.raises(ValueError, match=rf"^{switch}: .* needs .*gemv \(off: gemv=False\)"):
        resolve_plan(EngineConfig(quantization="int8", gemv=False, **{switch: True}), torch.device("cuda"),
                     hardware=HOPPER)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_with_per_channel_scales_the_plan_keeps_the_float_gemv_chain(method):
    plan = resolve_plan(EngineConfig(quantization=method), torch.device("cuda"), hardware=HOPPER)
    assert plan.quant_gemv and plan.norm_in_gemv and plan.l2_prefetch and plan.weight_block_size is None


def test_under_quantization_the_plan_runs_the_quantized_kernels_with_merged_projections():
    plan = resolve_plan(EngineConfig(quantization="fp8", weight_block_size=128), torch.device("cuda"),
                        hardware=HOPPER)
    assert (plan.quantization, plan.weight_block_size) == ("fp8", 128)
    assert plan.quant_gemv and plan.merge_projections and plan.gemv and plan.argmax_in_gemv   # the float LM head
    assert not (plan.norm_in_gemv or plan.l2_prefetch)
    assert plan.cuda_graphs and plan.attention_backend == "triton" and plan.num_scheduler_steps == 8
    assert not resolve_plan(EngineConfig(quantization="fp8", gemv=False), torch.device("cuda"),
                            hardware=HOPPER).quant_gemv
    assert not resolve_plan(EngineConfig(), torch.device("cuda"), hardware=HOPPER).quant_gemv     # float weights
