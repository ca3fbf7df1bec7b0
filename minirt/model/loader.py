"""Load a Hugging Face-format checkpoint (config.json, *.safetensors, tokenizer files) into `DecoderModel`.

Config, weights and tokenizer go through `transformers`, `safetensors` and `tokenizers`; a hub id is
fetched with `huggingface_hub.snapshot_download`. Only the model code itself is ours.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import torch

from minirt.model.decoder import DecoderModel

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """`torch.dtype`, its name ("bfloat16", "torch.float16", "fp32"...) or None -> a floating `torch.dtype`.

    None picks float32 on the CPU and bfloat16 on a GPU. Raises ValueError for other names.
    """
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: must be a floating-point dtype, got {dtype}")
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    name = str(dtype).removeprefix("torch.")
    name = aliases.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {dtype!r}")
    return getattr(torch, name)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """None picks CUDA when available, else the CPU. Raises ValueError for anything but an available
    "cpu" or "cuda[:index]"."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:index]', got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu' or 'cuda[:index]', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but torch.cuda.is_available() is False "
                         "(no GPU, or a CPU-only torch build); use device='cpu'")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A local directory, or a hub id downloaded (or found in the local HF cache) by `huggingface_hub`.

    Raises FileNotFoundError with one clear sentence when it is neither.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {str(path)!r} is a directory but has no config.json")
        return path
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(f"model: {str(model)!r} is not a checkpoint directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, HTTP errors: one message, not a stack of them
        raise FileNotFoundError(
            f"model: {str(model)!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). "
            "Pass the path of a local HF-format checkpoint, or download it first where there is network.") from None


def load_config(path: str | os.PathLike):
    """The checkpoint's `config.json` as a `transformers` config (`AutoConfig`), without loading any weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def load_weights(model: DecoderModel, path: Path) -> None:
    """Copy every tensor of `path/*.safetensors` into the model's parameters of the same name. Raises ValueError
    for a pre-quantized checkpoint (weights and scales, which chapter 10's `minirt.quant` loads)."""
    from safetensors.torch import load_file

    if getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(f"model: {str(path)!r} is pre-quantized (its config.json has a quantization_config); this "
                         "loader reads float weights: load it with minirt.LLM or minirt.quant.load_fp8_checkpoint")

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors weights in {str(path)!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for f in files:
        for name, tensor in load_file(f).items():
            if name not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"weights: unexpected tensor {name!r} in {os.path.basename(f)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
    missing = set(params) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights: missing tensors in {str(path)!r}: {sorted(missing)[:5]}")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer through `transformers.AutoTokenizer`, or None if it has none."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        logger.info("no tokenizer files in %s: prompts must be token ids", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(model: str | os.PathLike, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None) -> tuple[DecoderModel, object]:
    """Load an HF-format checkpoint into minirt's own `DecoderModel`, in eval mode.

    model: a local directory or a Hugging Face hub id. device: None = CUDA if available else CPU.
    dtype: `torch.dtype` or name; None = float32 on the CPU, bfloat16 on a GPU.
    Returns `(model, tokenizer)`; tokenizer is None when the checkpoint has no tokenizer files.
    Raises FileNotFoundError for a missing checkpoint, ValueError for unsupported architectures or
    mismatched weights.
    """
    path = resolve_checkpoint(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = load_config(path)
    with torch.device("meta"):
        net = DecoderModel(config)
    net = net.to_empty(device=device).to(dtype)
    net.model.rotary_emb = net.model.rotary_emb.__class__(config).to(device)  # buffers are not in the checkpoint
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    load_weights(net, path)
    net.eval().requires_grad_(False)
    net.name_or_path = str(model)
    net.checkpoint_path = str(path)
    return net, load_tokenizer(path)
