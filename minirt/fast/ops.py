"""The functions chapter 07's modules call (`minirt.fast.layers`): ops compiled by `torch.compile` (`fused`), the
torch contracts of the Triton kernels (what the CPU tests run in their place), and the kernels a plan picks
(`ModelKernels`, `model_kernels`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from minirt.attention import store_kv
from minirt.model.layers import apply_rotary, rms_norm, silu_and_mul

_FUSED: dict = {}


def fused(fn):
    """`fn` compiled by `torch.compile` (TorchInductor), once per process and shared by every layer.

    Eagerly, a chain of elementwise ops such as RMSNorm (`float`, `pow`, `mean`, `rsqrt`, `mul`, `to`, `mul`)
    is one kernel launch and one trip through memory per op; Inductor generates one kernel for the chain.
    `dynamic=True`: one compiled version serves every batch size above 1 (torch.compile specializes sizes 0
    and 1, so a single token gets its own). vLLM compiles its models the same way (`vllm/compilation/`).
    """
    if fn not in _FUSED:
        # Each function meets a few variants (tensor rank, dtype, one token or many): more than the default 8.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"   # torch < 2.7
        setattr(config, name, max(getattr(config, name), 64))
        _FUSED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _FUSED[fn]


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k (skipped when the weights are None), then the rotation of both: what
    `minirt.model.decoder.DecoderAttention` does between the projections and attention, as one function that
    `fused` compiles into one kernel (vLLM fuses the q/k norm and the rotary embedding the same way).

    q `[B, T, num_heads, head_dim]`, k `[B, T, num_kv_heads, head_dim]`, cos/sin `[B, T, rotary_dim]`.
    """
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def norm_rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`norm_and_rotate`, then the paged K/V write (`minirt.attention.store_kv`) of the rotated k and of v; returns
    the rotated q. The contract of `ModelKernels.rotate_and_store`, in plain torch.

    q `[1, T, H, D]`, k/v `[1, T, Hkv, D]` (a packed batch), k_cache/v_cache `[num_blocks, block_size, Hkv, D]`,
    slot_mapping `[T]`. `minirt.kernels.rotary_triton.norm_rotate_and_store_triton` does it in one kernel.
    """
    q, k = norm_and_rotate(q, k, cos, sin, q_weight, k_weight, eps)
    store_kv(k_cache, v_cache, k[0], v[0], slot_mapping)
    return q


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   silu_and_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, argmax_key: torch.Tensor | None = None,
                   weight_scale: torch.Tensor | None = None):
    """The contract of `ModelKernels.gemv`, in plain torch: `F.linear(x, weight, bias)`, or with `silu_and_mul`
    (weight a merged gate/up projection `[2 * I, K]`) `silu(gate) * up` `[..., I]`. With `norm_weight` `[K]` the
    RMSNorm before the projection comes first, on the stream `s = residual + x` (`x` when residual is None), and
    the result is `(out, s)`: `NormInGemvLayer`'s prologue. With `argmax_key` (the kernel's scratch, an int64 `[1]`
    holding 0, left so), out is the argmax of the product along its last dim instead: `GreedyGemvHead`'s greedy
    step. With `weight_scale` `[N]`, weight holds chapter 10's one-byte weights with one scale per output channel,
    taken as `minirt.quant.formats.dequantize` gives them. `minirt.kernels.gemv_triton.linear_gemv` does the same
    for one row in one kernel (two for the argmax)."""
    if weight_scale is not None:
        from minirt.quant.formats import dequantize

        weight = dequantize(weight, weight_scale, None, x.dtype)
    if norm_weight is not None:
        stream = x if residual is None else residual + x
        return gemv_reference(rms_norm(stream, norm_weight, eps), weight, bias, silu_and_mul=silu_and_mul,
                              argmax_key=argmax_key), stream
    y = F.linear(x, weight, bias)
    if argmax_key is not None:
        return y.argmax(dim=-1)
    if not silu_and_mul:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ModelKernels:
    """The functions the fast modules call. gemv: one-row products (`gemv_reference`'s contract) or None (cuBLAS
    through `F.linear`). rotate: `norm_and_rotate`'s contract. rotate_and_store: `norm_rotate_and_store`'s, or None
    (the attention backend writes K/V). l2_table: weights -> the `l2_prefetch` argument of `gemv`
    (`minirt.kernels.gemv_triton.l2_prefetch_table`), used where the plan asks for the L2 prefetch.
    silu_and_mul: `minirt.model.layers.silu_and_mul`'s contract (gate, up -> silu(gate) * up). quant_gemv: few-row
    products of quantized linears (`minirt.fast.quant_layers.quant_gemv_reference`'s contract), or None (the
    `QuantizedLinear` layers stay as loaded). quant_gemm: their many-row products (the same contract), or None
    (`minirt.fast.quant_layers.fast_quantized`'s torch choice)."""

    gemv: Callable | None = None
    rotate: Callable = norm_and_rotate
    rotate_and_store: Callable | None = None
    l2_table: Callable | None = None
    silu_and_mul: Callable = silu_and_mul
    quant_gemv: Callable | None = None
    quant_gemm: Callable | None = None


def model_kernels(plan) -> ModelKernels:
    """The kernels a plan asks for: the Triton ones (with PDL where the plan has it), else torch's."""
    gemv = rotate_and_store = l2_table = None
    rotate = fused(norm_and_rotate) if plan.fused_ops else norm_and_rotate
    act = fused(silu_and_mul) if plan.fused_ops else silu_and_mul
    if plan.gemv:
        from minirt.kernels.gemv_triton import l2_prefetch_table, linear_gemv

        gemv = functools.partial(linear_gemv, pdl=True) if plan.pdl else linear_gemv
        l2_table = l2_prefetch_table
    if plan.rotary_kernel:
        from minirt.kernels.rotary_triton import norm_and_rotate_triton, norm_rotate_and_store_triton

        rotate = functools.partial(norm_and_rotate_triton, pdl=plan.pdl)
        if plan.kv_write_in_rotary:
            rotate_and_store = functools.partial(norm_rotate_and_store_triton, pdl=plan.pdl)
    if plan.silu_and_mul_kernel:
        from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton as act
    quant_gemv = quant_gemm = None
    if plan.quant_gemv:
        from minirt.kernels.quant_gemm_triton import quant_gemm
        from minirt.kernels.quant_gemv_triton import quant_gemv

        quant_gemv = functools.partial(quant_gemv, pdl=True) if plan.pdl else quant_gemv
    return ModelKernels(gemv, rotate, rotate_and_store, l2_table, act, quant_gemv, quant_gemm)
