"""Chapter 07's model pieces, swapped into a loaded reference model once (`speed_up_model`).

The reference model (`minirt.model.decoder`) knows none of this. Here its modules are replaced, sharing their
parameters, by modules that run the same sums with fewer kernels and fewer trips through memory:

* merged projections: one GEMM for q/k/v and one for gate/up (`merge_linears`; vLLM's `QKVParallelLinear`);
* fused ops: the norms, the q/k norm with the rotation, and SiLU-and-multiply compiled (`fused`), or
  SiLU-and-multiply by a Triton kernel (`silu_and_mul_kernel`);
* one-row products through a matrix-vector kernel (`GemvLinear`), with SiLU-and-multiply in its epilogue and,
  at batch 1, each layer's norms in its prologue (`NormInGemvLayer`);
* the q/k norm and rotation in one kernel, optionally writing the K/V cache too (`FastAttention`);
* each GEMV asking the L2 cache for the next one's weights (`bind_l2_prefetch`);
* cos and sin looked up per position in a table filled once (`CachedRotaryEmbedding`);
* a greedy step's argmax in the LM head GEMV's epilogue (`GreedyGemvHead`).

Which of them run is the plan's (`minirt.fast.plan`); the functions that run them are a `ModelKernels`
(`minirt.fast.ops`): the Triton kernels by default, torch references in the CPU tests (`gemv_reference`, ...).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from minirt.fast.attention import KernelPagedAttention
from minirt.fast.ops import ModelKernels, fused, model_kernels
from minirt.model.decoder import DecoderAttention, DecoderLayer, DecoderModel
from minirt.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, add_rms_norm, rms_norm
from minirt.quant.linear import QuantizedLinear

def merge_linears(*linears: nn.Linear) -> nn.Linear | None:
    """One `nn.Linear` whose output is the outputs of `linears` side by side: one GEMM instead of several.

    Every projection of a decode step is a matrix-vector product that reads its weight once; small ones
    cost a kernel launch and a wave of thread blocks each, whatever their size. vLLM loads q/k/v into one
    `QKVParallelLinear` and gate/up into one `MergedColumnParallelLinear` for the same reason.
    Quantized layers merge into one `QuantizedLinear` (`minirt.fast.quant_layers.merge_quantized`), or give None
    where their scales cannot be concatenated.
    """
    first = linears[0]
    if isinstance(first, QuantizedLinear):
        from minirt.fast.quant_layers import merge_quantized

        return merge_quantized(*linears)
    merged = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                       device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            merged.bias.copy_(torch.cat([m.bias for m in linears]))
    return merged.requires_grad_(False)


def one_row(x: torch.Tensor) -> bool:
    """True for the input of a batch-1 decode step: one row of features."""
    return x.shape[:-1].numel() == 1


class GemvLinear(nn.Module):
    """`linear` (same weight and bias tensors) whose one-row inputs go to `gemv`, a function with
    `gemv_reference`'s contract; other inputs go through `F.linear` (cuBLAS). `[..., in] -> [..., out]`."""

    def __init__(self, linear: nn.Linear, gemv: Callable):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class GreedyGemvHead(GemvLinear):
    """The LM head as a `GemvLinear` (the same weight and bias tensors) that also takes a greedy step for one row:
    `greedy(x)`, x `[..., in]` with one row -> the argmax of its logits, int64 `[...]` (ties to the first index, as
    `torch.argmax`), from the GEMV's epilogue (`gemv(..., argmax_key=...)`): the logits never go to memory and no
    argmax kernel reads them back. The plan's argmax_in_gemv rule."""

    def __init__(self, linear: nn.Linear, gemv: Callable):
        super().__init__(linear, gemv)
        self.register_buffer("argmax_key", torch.zeros(1, dtype=torch.int64, device=linear.weight.device),
                             persistent=False)          # the kernel's scratch: 0 between calls

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        if not one_row(x):
            raise ValueError(f"x: greedy takes one row, got shape {tuple(x.shape)}")
        return self.gemv(x, self.weight, self.bias, argmax_key=self.argmax_key)


def lookup_cos_sin(table: torch.Tensor, positions: torch.Tensor):
    """table `[P, 2R]` (each position's cos, then its sin), positions `[...]` int64 -> cos, sin `[..., R]`: the two
    halves of the rows gathered at positions, views of one `[..., 2R]` tensor (one gather for both)."""
    rows = table[positions]
    half = table.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


class CachedRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` (the same inverse frequencies) whose cos and sin are looked up per position in a table its
    reference forward filled once, for positions 0 ... max_positions - 1 in `dtype` (vLLM's `cos_sin_cache`, each
    row a position's cos then its sin): a step then gathers its rows, one small kernel (compiled by `fused` with
    `fuse`), instead of the product, concatenation, cos, sin, scalings and casts, nine kernels; its cos and sin are
    the two halves of the gathered rows (views with strided rows). The same values: each row is what the
    reference computes for that position. Other dtypes go the reference's way. Positions must lie below
    max_positions (the engine holds them below max_model_len, at most the model's max_position_embeddings). The
    plan's rotary_cache rule."""

    def __init__(self, rotary: RotaryEmbedding, max_positions: int, dtype: torch.dtype, fuse: bool):
        nn.Module.__init__(self)
        self.register_buffer("inv_freq", rotary.inv_freq, persistent=False)
        self.attention_scaling, self.dtype = rotary.attention_scaling, dtype
        cos, sin = rotary(torch.arange(max_positions, device=rotary.inv_freq.device), dtype)
        self.register_buffer("cos_sin_table", torch.cat([cos, sin], dim=-1), persistent=False)
        self.lookup = fused(lookup_cos_sin) if fuse else lookup_cos_sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype != self.dtype:
            return super().forward(positions, dtype)
        return self.lookup(self.cos_sin_table, positions)


def _with_gemv(linear: nn.Module, kernels: ModelKernels) -> nn.Module:
    """The plan's module for one projection: a float `nn.Linear` through `GemvLinear` (kernels.gemv), a
    `QuantizedLinear` through `FastQuantizedLinear` (kernels.quant_gemv and quant_gemm; with per-channel scales and
    kernels.gemv, a `QuantizedGemvLinear` whose one-row steps take kernels.gemv); as it is where a kernel is None."""
    if isinstance(linear, QuantizedLinear):
        if kernels.quant_gemv is None:
            return linear
        from minirt.fast.quant_layers import fast_quantized

        return fast_quantized(linear, kernels.quant_gemv, kernels.gemv, kernels.quant_gemm)
    return linear if kernels.gemv is None else GemvLinear(linear, kernels.gemv)


def _merged(linears, merge: bool, kernels: ModelKernels):
    """The merged projection of `linears` through the plan's kernel, or None (not merging, or they cannot)."""
    merged = merge_linears(*linears) if merge else None
    return None if merged is None else _with_gemv(merged, kernels)


class FusedRMSNorm(RMSNorm):
    """`RMSNorm` (the same weight) run by compiled kernels (`fused`): one pass for the norm and, with a residual,
    for the addition before it (vLLM's `fused_add_rms_norm`)."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return fused(rms_norm)(x, self.weight, self.eps)
        return fused(add_rms_norm)(x, residual, self.weight, self.eps)


class FastAttention(nn.Module):
    """`DecoderAttention` (the same weights and sums) with merged q/k/v, the plan's projection kernel, and the q/k
    norm and rotation by `kernels.rotate`; with `kernels.rotate_and_store` and a paged backend that can attend
    alone (`KernelPagedAttention`), the rotation also writes K/V and the backend only attends."""

    def __init__(self, attn: DecoderAttention, merge: bool, kernels: ModelKernels):
        super().__init__()
        self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim = (
            attn.layer_idx, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv_sizes = [p.out_features for p in projections]
        self.qkv_proj = _merged(projections, merge, kernels)
        self.q_proj, self.k_proj, self.v_proj = ((None,) * 3 if self.qkv_proj is not None
                                                 else (_with_gemv(p, kernels) for p in projections))
        self.o_proj = _with_gemv(attn.o_proj, kernels)
        self.qk_norm = attn.qk_norm
        if attn.qk_norm:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.rotate, self.rotate_and_store = kernels.rotate, kernels.rotate_and_store

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.attend(*self.qkv_proj(x).split(self.qkv_sizes, dim=-1), cos, sin, attn)
        return self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, attn)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn) -> torch.Tensor:
        """Everything after the q/k/v projection: q/k norm, rotation, attention, o_proj. q/k/v `[B, T, heads * D]`."""
        B, T, _ = q.shape
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        if self.rotate_and_store is not None and isinstance(attn, KernelPagedAttention):
            q = self.rotate_and_store(q, k, v, cos, sin, *norm, *attn.kv_cache[self.layer_idx], attn.meta.slot_mapping)
            out = attn.attend(self.layer_idx, q)
        else:
            q, k = self.rotate(q, k, cos, sin, *norm)
            out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class FastMLP(nn.Module):
    """`GatedMLP` (the same weights and sums) with merged gate/up, the plan's projection kernel, and
    SiLU-and-multiply by `kernels.silu_and_mul` (compiled, or the Triton kernel) or, for one row through a GEMV, in
    the GEMV's epilogue."""

    def __init__(self, mlp: GatedMLP, merge: bool, kernels: ModelKernels):
        super().__init__()
        self.gate_up_proj = _merged((mlp.gate_proj, mlp.up_proj), merge, kernels)
        self.gate_proj, self.up_proj = ((None, None) if self.gate_up_proj is not None
                                        else (_with_gemv(mlp.gate_proj, kernels), _with_gemv(mlp.up_proj, kernels)))
        self.down_proj = _with_gemv(mlp.down_proj, kernels)
        self.act = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        if proj is None:
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        if isinstance(proj, GemvLinear) and one_row(x):        # the product in the GEMV's epilogue
            return self.down_proj(proj.gemv(x, proj.weight, proj.bias, silu_and_mul=True))
        if hasattr(proj, "silu_and_mul"):                      # FastQuantizedLinear: in quant_gemv's, few rows
            return self.down_proj(proj.silu_and_mul(x, self.act))
        return self.down_proj(self.act(*proj(x).chunk(2, dim=-1)))


class NormInGemvLayer(DecoderLayer):
    """`DecoderLayer` (the same modules) whose one-token steps run each norm, and the residual addition before it,
    in the prologue of the GEMV after it: the merged q/k/v projection, and the merged gate/up (with SiLU-and-multiply
    in its epilogue). Same sums, two kernels fewer per layer. Needs `FastAttention` and `FastMLP` with merged
    projections through `GemvLinear` (the plan's norm_in_gemv rule)."""

    def __init__(self, layer: DecoderLayer):
        nn.Module.__init__(self)
        if not (isinstance(getattr(layer.self_attn, "qkv_proj", None), GemvLinear)
                and isinstance(getattr(layer.mlp, "gate_up_proj", None), GemvLinear)):
            raise ValueError("norm_in_gemv: needs merged projections through the GEMV kernel (merge_projections, gemv)")
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp

    def forward(self, x, residual, cos, sin, attn):
        if not one_row(x):
            return super().forward(x, residual, cos, sin, attn)
        norm, qkv = self.input_layernorm, self.self_attn.qkv_proj
        out, residual = qkv.gemv(x, qkv.weight, qkv.bias, norm_weight=norm.weight, eps=norm.eps, residual=residual)
        x = self.self_attn.attend(*out.split(self.self_attn.qkv_sizes, dim=-1), cos, sin, attn)
        norm, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        act, residual = gate_up.gemv(x, gate_up.weight, gate_up.bias, silu_and_mul=True,
                                     norm_weight=norm.weight, eps=norm.eps, residual=residual)
        return self.mlp.down_proj(act), residual


def bind_l2_prefetch(model: DecoderModel, table: Callable, ahead: int = 1, count: int = 1) -> None:
    """Have every one-row GEMV of a decode step ask the L2 cache for the weights of the GEMV after it: q/k/v for
    o_proj, o_proj for gate/up, gate/up for down, down for the next layer's q/k/v (more generally, for the `count`
    GEMVs from the `ahead`-th one after it on). `table` turns a list of weights into the `l2_prefetch` argument
    bound into each `GemvLinear.gemv` (`minirt.kernels.gemv_triton.l2_prefetch_table`). The next weights then
    stream into L2 while the current GEMV runs. Call once, before any CUDA graph is captured.
    Raises ValueError naming ahead or count (below 1), or l2_prefetch (without merged GEMV projections)."""
    for name, value in (("ahead", ahead), ("count", count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    chain = [proj for layer in model.model.layers for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(proj, GemvLinear) for proj in chain):
        raise ValueError("l2_prefetch: needs merged projections through the GEMV kernel (merge_projections, gemv)")
    for i, proj in enumerate(chain):
        if after := chain[i + ahead:i + ahead + count]:
            proj.gemv = functools.partial(proj.gemv, l2_prefetch=table([p.weight for p in after]))


def speed_up_model(model: DecoderModel, plan, kernels: ModelKernels | None = None) -> DecoderModel:
    """Swap the plan's fast modules into a loaded reference `model`, in place, once; returns it.

    plan: a `minirt.fast.plan.Plan` (its fused_ops, merge_projections, gemv, norm_in_gemv, rotary_kernel,
    kv_write_in_rotary, l2_prefetch, silu_and_mul_kernel, rotary_cache, argmax_in_gemv). kernels: the functions to
    run (None: `model_kernels(plan)`). The parameter names no longer match the checkpoint's afterwards (merged
    projections): for serving only.
    """
    kernels = model_kernels(plan) if kernels is None else kernels
    body = model.model
    for i, layer in enumerate(body.layers):
        layer.self_attn = FastAttention(layer.self_attn, plan.merge_projections, kernels)
        layer.mlp = FastMLP(layer.mlp, plan.merge_projections, kernels)
        if plan.fused_ops:
            layer.input_layernorm = FusedRMSNorm(layer.input_layernorm)
            layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
        if plan.norm_in_gemv:
            body.layers[i] = NormInGemvLayer(layer)
    if plan.fused_ops:
        body.norm = FusedRMSNorm(body.norm)
    if plan.rotary_cache:
        body.rotary_emb = CachedRotaryEmbedding(body.rotary_emb, model.config.max_position_embeddings, model.dtype,
                                                fuse=plan.fused_ops)
    if plan.argmax_in_gemv:
        if kernels.gemv is None:
            raise ValueError("argmax_in_gemv: needs the GEMV kernel (gemv)")
        model.lm_head = GreedyGemvHead(model.lm_head, kernels.gemv)
    else:
        model.lm_head = _with_gemv(model.lm_head, kernels)
    if plan.l2_prefetch:
        bind_l2_prefetch(model, kernels.l2_table)
    return model
