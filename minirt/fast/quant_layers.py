"""Chapter 10's fast path: the module swapped in for each `QuantizedLinear` (`minirt.quant.linear`) by the plan.

The reference `QuantizedLinear.forward` dequantizes its whole weight into the activations' dtype and runs one
`F.linear`: correct, and slower than the float model, since every call writes and reads a float copy of the weight.
`FastQuantizedLinear` (the same weight, scale and bias tensors) reads the one-byte weights themselves:

* one row, per-channel scales (`QuantizedGemvLinear`): the float model's GEMV kernel with the scales
  (`minirt.kernels.gemv_triton.linear_gemv(weight_scale=...)`), so that the batch-1 step keeps every fusion built
  around that kernel (the norm in its prologue, SiLU-and-multiply in its epilogue, the L2 prefetch of the next
  weights) and reads 1 byte per weight instead of 2;
* few rows (while rows x out_features <= `GEMV_OUTPUTS`, and one row with block scales): `quant_gemv`, the Triton
  GEMV that dequantizes in registers (`minirt.kernels.quant_gemv_triton`): it multiplies on the vector units, so
  its time grows with the rows times the outputs, and past that product the GEMM below is faster
  (`lab/pages/quantized-linears.md`: 2 rows of the 4096-wide q/k/v, 8 of the 1024-wide o and down);
* more rows (prefill chunks, large decode batches), where the plan has its kernels: `quant_gemm`, the Triton GEMM
  that converts each weight tile in registers and multiplies on the tensor cores (`minirt.kernels.quant_gemm_triton`,
  Marlin's W8A16 scheme), again one byte per weight read;
* more rows without those kernels, FP8 weights with per-channel scales on a GPU with FP8 tensor
  cores (compute capability 8.9 or later): `scaled_mm_linear`, the activations quantized to FP8 per token (one
  dynamic scale per row, `amax / 448`) and one `torch._scaled_mm` with both scales in its epilogue (vLLM's
  `Fp8LinearMethod` with dynamic per-token activation scales); its result differs from the contract by the
  activations' rounding to e4m3 (about 2^-4 of each, relative);
* more rows otherwise (int8, block scales, older GPUs): `dequantize_linear`, the reference's dequantize-then-GEMM.

`merge_quantized` concatenates q/k/v (or gate/up) into one layer, weights and scales, so that the merged
projections of `minirt.fast.layers` keep working on quantized models.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minirt.fast.layers import GemvLinear, one_row
from minirt.quant.formats import QMAX, dequantize
from minirt.quant.linear import QuantizedLinear

GEMV_OUTPUTS = 8192     # rows x out_features up to which few rows take the GEMV (one row always does)


def quant_gemv_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
                         bias: torch.Tensor | None = None, *, silu_and_mul: bool = False) -> torch.Tensor:
    """The contract of `quant_gemv`, in plain torch: `x.float() @ dequantize(q, scale, block_size).T (+ bias)`,
    cast to x.dtype. x `[..., K]`, q `[N, K]` -> `[..., N]`; with `silu_and_mul` (q a merged gate/up projection
    `[2 * I, K]`), `silu(gate) * up` `[..., I]` of the two halves (each rounded to x.dtype first)."""
    y = x.float() @ dequantize(q, scale, block_size).T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if not silu_and_mul:
        return y
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def dequantize_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """`QuantizedLinear.forward`'s product: the weight dequantized into x's dtype, then one `F.linear` (cuBLAS)."""
    return F.linear(x, dequantize(q, scale, block_size, x.dtype), bias)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> `(x_q [M, K]` float8_e4m3fn, `scale [M, 1]` float32) with `x ~ x_q * scale`, one scale per row
    (dynamic per-token scaling: `amax(|row|) / 448`, at least `minirt.quant.formats.MIN_SCALE`)."""
    from minirt.quant.formats import MIN_SCALE

    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX["fp8"]).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn), scale


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 product on the tensor cores: x `[..., K]` quantized per row (`quantize_rows_fp8`), times q `[N, K]`
    float8_e4m3fn with per-channel scales `[N]`, both scales applied in `torch._scaled_mm`'s epilogue (row-wise
    scaling), the result in x.dtype, plus the bias. Needs a CUDA device of compute capability 8.9 or later,
    block_size None, and K and N multiples of 16 (`scaled_mm_missing`); x in another dtype than bfloat16 (the
    row-wise scaled GEMM's only output) goes to `dequantize_linear`."""
    if x.dtype != torch.bfloat16:
        return dequantize_linear(x, q, scale, block_size, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x_q, x_scale = quantize_rows_fp8(x.reshape(-1, k))
    y = torch._scaled_mm(x_q, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, q.shape[0])


def scaled_mm_missing(layer: QuantizedLinear) -> list[str]:
    """What `scaled_mm_linear` needs for `layer` and does not have (empty: it can run)."""
    device = layer.weight.device
    missing = []
    if device.type != "cuda":
        missing.append(f"a CUDA device (got {device.type})")
    elif (capability := torch.cuda.get_device_capability(device)) < (8, 9):
        missing.append(f"FP8 tensor cores (compute capability 8.9 or later, got {capability[0]}.{capability[1]})")
    if layer.method != "fp8":
        missing.append(f"FP8 weights (got {layer.method})")
    if layer.block_size is not None:
        missing.append(f"per-channel scales (got {layer.block_size} x {layer.block_size} blocks)")
    if layer.in_features % 16 or layer.out_features % 16:
        missing.append(f"in and out features multiples of 16 (got {layer.in_features}, {layer.out_features})")
    return missing


class FastQuantizedLinear(nn.Module):
    """`QuantizedLinear` (the same weight, weight_scale and bias tensors) whose inputs of few rows (`few_rows`) go to
    `gemv` (`quant_gemv`'s contract: x, q, scale, block_size, bias) and larger ones to `many_rows` (the same
    arguments: `scaled_mm_linear` or `dequantize_linear`). `[..., in_features] -> [..., out_features]`."""

    def __init__(self, layer: QuantizedLinear, gemv: Callable, many_rows: Callable):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.method, self.block_size = layer.method, layer.block_size
        self.register_buffer("weight", layer.weight)
        self.register_buffer("weight_scale", layer.weight_scale)
        self.bias = layer.bias
        self.gemv, self.many_rows = gemv, many_rows

    def few_rows(self, x: torch.Tensor) -> bool:
        """True where `x` goes to the GEMV: one row, or rows x out_features <= GEMV_OUTPUTS. A shape, not a value:
        the same branch in every replay of a CUDA graph."""
        return x.shape[:-1].numel() <= max(1, GEMV_OUTPUTS // self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows(x):
            return self.gemv(x, self.weight, self.weight_scale, self.block_size, self.bias)
        return self.many_rows(x, self.weight, self.weight_scale, self.block_size, self.bias)

    def silu_and_mul(self, x: torch.Tensor, act: Callable) -> torch.Tensor:
        """For a merged gate/up projection: `act(gate, up)` of its two halves, `[..., out_features // 2]`; few rows
        take SiLU-and-multiply in the GEMV's epilogue (`gemv(..., silu_and_mul=True)`), more go through `act`."""
        if self.few_rows(x):
            return self.gemv(x, self.weight, self.weight_scale, self.block_size, self.bias, silu_and_mul=True)
        return act(*self(x).chunk(2, dim=-1))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method!r}, "
                f"block_size={self.block_size}, many_rows={getattr(self.many_rows, '__name__', self.many_rows)}")


class QuantizedGemvLinear(GemvLinear):
    """A `QuantizedLinear` with one scale per output channel as a `GemvLinear`: its one-row inputs go to `gemv`, the
    float model's one-row product (`minirt.fast.ops.gemv_reference`'s contract) with the scales bound
    (`gemv(..., weight_scale=scale)`), others to `rows`, a `FastQuantizedLinear` of the same tensors. Being a
    `GemvLinear`, it takes part in every fusion the plan builds around that kernel for one-token steps
    (`minirt.fast.layers`: the norm prologue, SiLU-and-multiply in the epilogue, the L2 prefetch). `[..., in] ->
    [..., out]`."""

    def __init__(self, gemv: Callable, rows: FastQuantizedLinear):
        nn.Module.__init__(self)
        if rows.block_size is not None:
            raise ValueError(f"rows: the float GEMV applies one scale per output channel, got "
                             f"{rows.block_size} x {rows.block_size} blocks")
        self.in_features, self.out_features = rows.in_features, rows.out_features
        self.rows = rows
        self.weight, self.weight_scale, self.bias = rows.weight, rows.weight_scale, rows.bias
        self.gemv = functools.partial(gemv, weight_scale=rows.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv(x, self.weight, self.bias) if one_row(x) else self.rows(x)

    def silu_and_mul(self, x: torch.Tensor, act: Callable) -> torch.Tensor:
        """`FastQuantizedLinear.silu_and_mul`, one row in the float GEMV's epilogue."""
        if one_row(x):
            return self.gemv(x, self.weight, self.bias, silu_and_mul=True)
        return self.rows.silu_and_mul(x, act)


def fast_quantized(layer: QuantizedLinear, gemv: Callable | None = None, row_gemv: Callable | None = None,
                   gemm: Callable | None = None) -> FastQuantizedLinear | QuantizedGemvLinear:
    """The plan's fast module for `layer`: `gemv` for few rows (None: the Triton `quant_gemv`), and for more rows
    `gemm` (`quant_gemv`'s contract: the Triton `quant_gemm`), else `scaled_mm_linear` where it can run
    (`scaled_mm_missing`), else `dequantize_linear`; with `row_gemv` (the float model's one-row kernel) and
    per-channel scales, wrapped in a `QuantizedGemvLinear` whose one-row steps take it."""
    if gemv is None:
        from minirt.kernels.quant_gemv_triton import quant_gemv as gemv
    if gemm is None:
        gemm = dequantize_linear if scaled_mm_missing(layer) else scaled_mm_linear
    fast = FastQuantizedLinear(layer, gemv, gemm)
    return fast if row_gemv is None or layer.block_size is not None else QuantizedGemvLinear(row_gemv, fast)


def merge_quantized(*layers: QuantizedLinear) -> QuantizedLinear | None:
    """One `QuantizedLinear` whose output is the outputs of `layers` side by side (weights, scales and biases
    concatenated along the output dim), as `minirt.fast.layers.merge_linears` merges float ones; None where they
    cannot merge: different methods, block sizes, inputs or bias presence, or block scales with a layer before the
    last whose out_features is not a multiple of the block size (its last block row would straddle two layers)."""
    first = layers[0]
    same = all(isinstance(m, QuantizedLinear) and m.method == first.method and m.block_size == first.block_size
               and m.in_features == first.in_features and (m.bias is None) == (first.bias is None) for m in layers)
    b = first.block_size
    if not same or (b is not None and any(m.out_features % b for m in layers[:-1])):
        return None
    weight = torch.cat([m.weight for m in layers])
    scale = torch.cat([m.weight_scale for m in layers])
    bias = torch.cat([m.bias.detach() for m in layers]) if first.bias is not None else None
    return QuantizedLinear.from_quantized(weight, scale, b, bias)
