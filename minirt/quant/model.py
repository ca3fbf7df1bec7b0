"""Quantizing a loaded model, and loading (and writing) pre-quantized Hugging Face FP8 checkpoints.

Two ways to a model whose decoder linears are `QuantizedLinear`:

* quantize at load: a float checkpoint loads as chapter 00 loads it, then `quantize_model` swaps every decoder
  layer's q/k/v/o and gate/up/down `nn.Linear` for a `QuantizedLinear` (vLLM's `quantization="fp8"` on a bf16
  checkpoint does the same, layer by layer, as its weights load). The embeddings and the LM head stay in float, as
  in vLLM and in the published FP8 checkpoints: they are a small share of a decode step's bytes and the logits are
  where rounding errors show most.
* a pre-quantized checkpoint: its `config.json` says so in `quantization_config` (the format of transformers'
  `FineGrainedFP8Config`, which vLLM's `Fp8Config` and SGLang read too, as DeepSeek-V3 and Qwen3-FP8 ship it):

      "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}

  and each quantized layer `<layer>` holds `<layer>.weight` (float8_e4m3fn, `[N, K]`) and
  `<layer>.weight_scale_inv` (float32, `[ceil(N/128), ceil(K/128)]`; despite the name it multiplies: W ~ weight *
  weight_scale_inv). Without `weight_block_size` the scale is one per tensor (shape `[]`), which loads here as
  the same scale for every output channel; vLLM's per-tensor FP8 checkpoints name it `<layer>.weight_scale`, read
  too. Which layers are quantized is what the tensors say (a layer with a scale); `modules_to_not_convert` names
  the others. `activation_scheme: "dynamic"` means the
  activations carry no stored scale: weight-only here, per-token scales computed at run time by FP8 GEMMs.

`save_fp8_checkpoint` writes that format from a float checkpoint (tests and chapter 10 build their FP8 checkpoints
with it; nothing downloads).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from minirt.model.decoder import DecoderModel
from minirt.model.loader import load_config, load_tokenizer, resolve_checkpoint, resolve_device, resolve_dtype
from minirt.quant.formats import METHODS, dequantize, quantize, scale_shape
from minirt.quant.linear import QuantizedLinear

#: The linear layers of a decoder layer that are quantized (their attribute paths under `model.layers[i]`).
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\.(" + "|".join(re.escape(n) for n in DECODER_LINEARS) + r")$")
#: The `quant_method`s of a `quantization_config` this package loads.
CHECKPOINT_METHODS = ("fp8",)


def is_decoder_linear(name: str) -> bool:
    """True for the module names `quantize_model` swaps: `model.layers.<i>.self_attn.{q,k,v,o}_proj` and
    `model.layers.<i>.mlp.{gate,up,down}_proj`."""
    return _DECODER_LINEAR.match(name) is not None


def quantize_model(model: DecoderModel, method: str, block_size: int | None = None) -> list[str]:
    """Swap each decoder layer's q/k/v/o and gate/up/down `nn.Linear` for its `QuantizedLinear`, in place.

    method: "int8" or "fp8"; block_size: None (per output channel) or B (B x B blocks). The embeddings, the norms
    and the LM head stay as they are. Returns the names of the swapped modules, in model order (7 per layer).
    Raises ValueError for an unknown method or bad block_size, before anything is swapped.
    """
    if method not in METHODS:
        raise ValueError(f"quantization: must be one of {METHODS}, got {method!r}")
    targets = [(name, module) for name, module in model.named_modules()
               if is_decoder_linear(name) and isinstance(module, nn.Linear)]
    scale_shape((1, 1), block_size)                                         # a bad block_size raises here
    for name, linear in targets:
        parent, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), attr, QuantizedLinear.from_linear(linear, method, block_size))
    return [name for name, _ in targets]


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    """The model's `QuantizedLinear` modules by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face FP8 checkpoints
# ---------------------------------------------------------------------------------------------------------------

def quantization_config_of(model_config) -> dict | None:
    """A checkpoint config's `quantization_config` as a plain dict, or None for a float checkpoint."""
    qc = getattr(model_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc.to_dict() if hasattr(qc, "to_dict") else qc)


def checkpoint_quantization(model_config) -> tuple[str, int | None] | None:
    """`(method, block_size)` of a pre-quantized checkpoint's weights, from its `quantization_config`; None for a
    float checkpoint. `weight_block_size: [B, B]` gives B; absent or null gives None (one scale per tensor, loaded
    as one per channel). Raises ValueError naming the field for an unknown `quant_method` (only "fp8" loads),
    an `activation_scheme` other than "dynamic" (static activation scales are not read), or a block shape that
    is not square positive integers."""
    qc = quantization_config_of(model_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config.quant_method: {method!r} is not supported (minirt loads "
                         f"{CHECKPOINT_METHODS} checkpoints, or float ones)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme: only 'dynamic' is supported (weight-only; no "
                         f"stored activation scales are read), got {scheme!r}")
    blocks = qc.get("weight_block_size")
    if blocks is None:
        return method, None
    if (not isinstance(blocks, (list, tuple)) or len(blocks) != 2 or blocks[0] != blocks[1]
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks)):
        raise ValueError(f"quantization_config.weight_block_size: expected [B, B] (square blocks of a positive "
                         f"integer B) or null, got {blocks!r}")
    return method, blocks[0]


def _tensor_files(path: Path) -> dict[str, str]:
    """Every tensor name of `path/*.safetensors` -> its file (a layer's weight and scale may sit in two shards)."""
    from safetensors import safe_open

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors weights in {str(path)!r}")
    index = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            index.update((name, f) for name in handle.keys())
    return index


def scale_name(index, module: str, block_size: int | None) -> str | None:
    """The name of `module`'s weight scale in the checkpoint, or None for a float layer: `weight_scale_inv`
    (transformers' FineGrainedFP8 and DeepSeek's name), or with one scale per tensor also `weight_scale` (vLLM's)."""
    for suffix in ("weight_scale_inv",) if block_size is not None else ("weight_scale_inv", "weight_scale"):
        if f"{module}.{suffix}" in index:
            return f"{module}.{suffix}"
    return None


def _read(index: dict[str, str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(index[name], framework="pt") as handle:
        return handle.get_tensor(name)


def _per_channel(scale: torch.Tensor, out_features: int, name: str) -> torch.Tensor:
    """A per-tensor (`[]`, `[1]`) or per-channel (`[N]`, `[N, 1]`) scale as `[N]`. Raises ValueError otherwise."""
    if scale.numel() == 1:
        return scale.reshape(1).expand(out_features).clone()
    if scale.numel() == out_features and scale.dim() in (1, 2) and scale.shape[0] == out_features:
        return scale.reshape(out_features)
    raise ValueError(f"weights: {name!r} has shape {tuple(scale.shape)}; with weight_block_size null a scale is "
                     f"one per tensor ([]) or one per output channel ([{out_features}])")


def load_fp8_checkpoint(model: str | os.PathLike, device: torch.device | str | None = None,
                        dtype: torch.dtype | str | None = None) -> tuple[DecoderModel, object]:
    """Load a pre-quantized Hugging Face FP8 checkpoint (see the module docstring) into a `DecoderModel` whose
    quantized layers are `QuantizedLinear` (method "fp8", the checkpoint's block size), in eval mode.

    device, dtype: as `minirt.load_model` (dtype is that of the float tensors: embeddings, norms, LM head, and of
    the activations). A quantized tensor of a layer kept in float here (an LM head or an embedding stored in FP8)
    is dequantized into it. Returns `(model, tokenizer)`.
    Raises ValueError for a float checkpoint (no `quantization_config`), those `checkpoint_quantization` raises,
    a quantized weight that is not float8_e4m3fn, a scale whose shape does not match its weight and block size, or
    a tensor the model does not have; FileNotFoundError for a missing checkpoint.
    """
    path = resolve_checkpoint(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = load_config(path)
    resolved = checkpoint_quantization(config)
    if resolved is None:
        raise ValueError(f"model: {str(model)!r} has no quantization_config in its config.json (a float "
                         "checkpoint): load it with minirt.load_model, or quantize it with quantization='int8'|'fp8'")
    method, block_size = resolved
    index = _tensor_files(path)
    with torch.device("meta"):                # nothing allocated until `to_empty` on the device
        net = DecoderModel(config)
        for name, linear in list(net.named_modules()):
            if is_decoder_linear(name) and scale_name(index, name, block_size) is not None:
                parent, attr = name.rsplit(".", 1)
                setattr(net.get_submodule(parent), attr,
                        QuantizedLinear(linear.in_features, linear.out_features, method, block_size,
                                        bias=linear.bias is not None))
    net = net.to_empty(device=device)
    for module in net.modules():           # float parameters in dtype; the quantized buffers keep theirs
        for pname, p in module.named_parameters(recurse=False):
            setattr(module, pname, nn.Parameter(p.to(dtype), requires_grad=False))
    net.model.rotary_emb = net.model.rotary_emb.__class__(config).to(device)  # buffers are not in the checkpoint
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    _load_fp8_tensors(net, index, block_size)
    net.eval().requires_grad_(False)
    net.name_or_path = str(model)
    net.checkpoint_path = str(path)
    return net, load_tokenizer(path)


def _load_fp8_tensors(net: DecoderModel, index: dict[str, str], block_size: int | None) -> None:
    """Copy the checkpoint's tensors into `net`: weight + scale into each `QuantizedLinear`, the rest (float, or
    FP8 dequantized for a layer kept in float) into the parameters of the same name."""
    targets = dict(net.named_parameters(remove_duplicate=False))
    quantized = quantized_modules(net)
    for name, layer in quantized.items():
        targets[f"{name}.weight"] = layer.weight
        targets[f"{name}.weight_scale"] = layer.weight_scale
    loaded: set[str] = set()
    with torch.no_grad():
        for name in index:
            if "rotary_emb" in name:
                continue
            module = name.rsplit(".", 1)[0]
            key = scale_name(index, module, block_size)
            if name == key:
                continue                                  # read with its weight
            tensor = _read(index, name)
            if name.endswith(".weight") and key is not None:
                if tensor.dtype != torch.float8_e4m3fn:
                    raise ValueError(f"weights: {name!r} has a {key.rsplit('.', 1)[1]}, so it must be "
                                     f"float8_e4m3fn, got {tensor.dtype}")
                scale = _read(index, key).float()
                if block_size is None:
                    scale = _per_channel(scale, tensor.shape[0], key)
                if module in quantized:
                    layer = quantized[module]
                    new = QuantizedLinear.from_quantized(tensor, scale, block_size)   # checks the scale's shape
                    layer.weight.copy_(new.weight)
                    layer.weight_scale.copy_(new.weight_scale)
                    loaded.update((f"{module}.weight", f"{module}.weight_scale"))
                    continue
                tensor = dequantize(tensor, _check_scale(scale, tensor, block_size, key), block_size)
            if name not in targets:
                raise ValueError(f"weights: unexpected tensor {name!r} in {os.path.basename(index[name])}")
            if tensor.dtype == torch.float8_e4m3fn:
                raise ValueError(f"weights: {name!r} is float8_e4m3fn but has no {module + '.weight_scale_inv'!r}")
            targets[name].copy_(tensor)
            loaded.add(name)
    missing = set(targets) - loaded
    if net.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights: missing tensors: {sorted(missing)[:5]}")


def _check_scale(scale: torch.Tensor, weight: torch.Tensor, block_size: int | None, name: str) -> torch.Tensor:
    expected = scale_shape(tuple(weight.shape), block_size)
    if tuple(scale.shape) != expected:
        raise ValueError(f"weights: {name!r} has shape {tuple(scale.shape)}, expected {expected} for a "
                         f"{tuple(weight.shape)} weight with weight_block_size={block_size}")
    return scale


def save_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, block_size: int | None = 128,
                        modules_to_not_convert: tuple[str, ...] = ("lm_head",)) -> Path:
    """Write a Hugging Face FP8 checkpoint (the format `load_fp8_checkpoint` and vLLM read) from a float one.

    Each decoder linear's `<layer>.weight` becomes float8_e4m3fn (`minirt.quant.formats.quantize`, method "fp8")
    with its `<layer>.weight_scale_inv` float32: `[ceil(N/B), ceil(K/B)]` for block_size B (the published
    checkpoints use 128), `[]` (one scale per tensor, as transformers writes it) for block_size None. Every other
    tensor (embeddings, norms, LM head, biases) is copied as it is; the tokenizer and generation files too;
    config.json gains the `quantization_config`. Returns `dst`. Raises ValueError for a checkpoint that is already
    quantized or a bad block_size.
    """
    from safetensors.torch import load_file, save_file

    src, dst = resolve_checkpoint(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"model: {str(src)!r} is already quantized (its config.json has a quantization_config)")
    scale_shape((1, 1), block_size)                                         # a bad block_size raises here
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(src / "*.safetensors"))):
        for name, tensor in load_file(f).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and is_decoder_linear(module):
                # per tensor: one block covering the whole weight, a [1, 1] scale stored as [] (transformers' form)
                q, scale = quantize(tensor, "fp8", block_size or max(tensor.shape))
                tensors[name] = q
                tensors[f"{module}.weight_scale_inv"] = scale if block_size else scale.reshape(())
            else:
                tensors[name] = tensor.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block_size, block_size] if block_size else None,
                                     "modules_to_not_convert": list(modules_to_not_convert)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
