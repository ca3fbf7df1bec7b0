"""A linear layer whose weight is stored quantized (int8 or FP8 e4m3) and dequantized in its forward.

`QuantizedLinear` holds what `minirt.quant.formats.quantize` returns, `q [out_features, in_features]` and its
float32 scales, instead of a float weight: 1 byte per weight instead of 2 (bf16) or 4 (float32), plus one 4-byte
scale per output channel or per B x B block. Its forward is the torch reference every fast kernel is tested
against: dequantize the whole weight into the activations' dtype, then one `F.linear`. It saves memory, not time:
the bytes a decode step reads shrink only when a kernel reads `q` itself and dequantizes in registers
(`minirt.kernels.quant_gemv_triton`).

This is weight-only quantization as vLLM runs it where FP8 tensor cores are missing (its `Fp8LinearMethod` falls
back to dequantizing the weight, "weight-only FP8", on GPUs before Ada/Hopper; its Marlin path does the same in
registers) and as FP8 checkpoints store it (`weight` + `weight_scale_inv`, see `minirt.quant.model`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minirt.quant.formats import STORAGE_DTYPE, check_method, dequantize, method_of, quantize, scale_shape


class QuantizedLinear(nn.Module):
    """`y = x @ dequantize(weight, weight_scale).T + bias`, the weight stored as int8 or float8_e4m3fn.

    in_features, out_features: K and N. method: "int8" or "fp8". block_size: None (one scale per output channel,
    `weight_scale [N]`) or B (one per B x B block, `weight_scale [ceil(N/B), ceil(K/B)]`).
    Buffers: `weight [N, K]` (int8 or float8_e4m3fn), `weight_scale` float32 (it multiplies: W ~ weight *
    weight_scale). Parameter `bias [N]` in the model's dtype, or None. The buffers are built empty (zeros, scale 1);
    `from_linear` fills them from a float `nn.Linear`, a checkpoint loader copies them in. Do not cast the layer
    (`module.to(torch.bfloat16)` would cast the FP8 buffers and the scales too): the activations' dtype picks the
    dtype of the product.
    """

    def __init__(self, in_features: int, out_features: int, method: str, block_size: int | None = None,
                 bias: bool = False, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        check_method(method)
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.block_size = block_size
        shape = scale_shape((out_features, in_features), block_size)
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device,
                                                   dtype=STORAGE_DTYPE[method]))
        self.register_buffer("weight_scale", torch.ones(shape, device=device, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, block_size: int | None = None) -> "QuantizedLinear":
        """The `QuantizedLinear` of a float `nn.Linear`: its weight quantized (`formats.quantize`), its bias kept
        as it is (same tensor), on the same device. Raises ValueError for an unknown method or bad block_size."""
        q, scale = quantize(linear.weight, method, block_size)
        layer = cls(linear.in_features, linear.out_features, method, block_size, bias=False,
                    device=linear.weight.device)
        layer.weight = q
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = linear.bias
        return layer

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: int | None,
                       bias: torch.Tensor | None = None) -> "QuantizedLinear":
        """The layer holding an already quantized `weight [N, K]` (int8 or float8_e4m3fn) and its float32 scales
        (a pre-quantized checkpoint's tensors). Raises ValueError when the scales' shape is not the one block_size
        gives (`formats.scale_shape`) or the weight's dtype is not a quantized one."""
        method = method_of(weight.dtype)
        n, k = weight.shape
        expected = scale_shape((n, k), block_size)
        if tuple(weight_scale.shape) != expected:
            raise ValueError(f"weight_scale: expected shape {expected} for a {(n, k)} weight with "
                             f"weight_block_size={block_size}, got {tuple(weight_scale.shape)}")
        layer = cls(k, n, method, block_size, bias=False, device=weight.device)
        layer.weight = weight
        layer.weight_scale = weight_scale.float()
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight `[out_features, in_features]` in `dtype`: `weight * weight_scale` in float32, cast."""
        return dequantize(self.weight, self.weight_scale, self.block_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., in_features]` -> `[..., out_features]` in x's dtype."""
        # Why the whole weight is dequantized first: one F.linear is the same product the float model computes,
        # so this layer equals `x @ dequant(W).T` exactly, the contract every fused kernel is checked against.
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method!r}, "
                f"block_size={self.block_size}, bias={self.bias is not None}")
