"""Chapter 10: fewer bytes per token - weight-only quantization to int8 and FP8.

`formats`: quantize / dequantize with per-channel or block scales. `linear`: `QuantizedLinear`, the layer that
stores them. `model`: `quantize_model` (quantize at load), `load_fp8_checkpoint` and `save_fp8_checkpoint`
(Hugging Face FP8 checkpoints, read by their `quantization_config`).
"""

from minirt.quant.formats import METHODS, QMAX, dequantize, quantize, scale_shape
from minirt.quant.linear import QuantizedLinear
from minirt.quant.model import (checkpoint_quantization, load_fp8_checkpoint, quantize_model, quantized_modules,
                                save_fp8_checkpoint)

__all__ = ["METHODS", "QMAX", "QuantizedLinear", "checkpoint_quantization", "dequantize", "load_fp8_checkpoint",
           "quantize", "quantize_model", "quantized_modules", "save_fp8_checkpoint", "scale_shape"]
