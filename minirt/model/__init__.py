"""Chapter 00: the model. minirt's own decoder (Qwen3 / Qwen2 / Llama) loaded from HF-format checkpoints."""

from minirt.model.decoder import SUPPORTED_ARCHITECTURES, DecoderModel
from minirt.model.loader import load_model, resolve_device, resolve_dtype

__all__ = ["DecoderModel", "SUPPORTED_ARCHITECTURES", "load_model", "resolve_device", "resolve_dtype"]
