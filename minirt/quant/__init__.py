"""Chapter 10: fewer bytes per token - weight-only quantization to int8 and FP8 (`formats`)."""

from minirt.quant.formats import METHODS, QMAX, dequantize, quantize, scale_shape

__all__ = ["METHODS", "QMAX", "dequantize", "quantize", "scale_shape"]
