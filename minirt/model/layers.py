"""The building blocks of a decoder-only transformer: RMSNorm, rotary embeddings, the gated MLP.

These are written out (rather than imported from `transformers`) because they are part of what the
course teaches. Numerics follow `transformers`' Qwen3/Qwen2/Llama code so that logits agree in float32.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


def head_dim_of(config) -> int:
    """Channels per attention head: `config.head_dim` where the checkpoint sets it (Qwen3 does, and it need
    not equal hidden_size / num_heads), else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


_FUSED: dict = {}


def fused(fn):
    """`fn` compiled by `torch.compile` (TorchInductor), once per process and shared by every layer.

    Eagerly, a chain of elementwise ops such as RMSNorm (`float`, `pow`, `mean`, `rsqrt`, `mul`, `to`, `mul`)
    is one kernel launch and one trip through memory per op; Inductor generates one kernel for the chain.
    `dynamic=True`: one compiled version serves every batch size above 1 (torch.compile specializes sizes 0
    and 1, so a single token gets its own). Chapter 07 turns this on
    (`fused_ops=True`); vLLM compiles its models the same way (`vllm/compilation/`).
    """
    if fn not in _FUSED:
        # Each function meets a few variants (tensor rank, dtype, one token or many): more than the default 8.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"   # torch < 2.7
        setattr(config, name, max(getattr(config, name), 64))
        _FUSED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _FUSED[fn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x**2) + eps) * weight` over the last dim, in float32 and cast back, as Llama and Qwen do."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual addition and the next norm in one pass: `(rms_norm(s), s)` with `s = residual + x`.

    Compiled (`fused`), the sum is read once for both outputs instead of being written by an add kernel and
    read back by the norm's: vLLM's `fused_add_rms_norm`, which its models use between every two sublayers.
    """
    x = residual + x
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

    `forward(x)`: `y = x / sqrt(mean(x**2) + eps) * weight` (see `rms_norm`), `[..., hidden_size]` in and out.
    `forward(x, residual)`: adds `x` into the residual stream first and returns `(y, new residual)`
    (see `add_rms_norm`). With `fuse = True` the same functions run as compiled kernels (`fused`).
    """

    fuse = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return (fused(rms_norm) if self.fuse else rms_norm)(x, self.weight, self.eps)
        return (fused(add_rms_norm) if self.fuse else add_rms_norm)(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, "RoFormer", section 3.4).

    Each pair of channels of q and k is rotated by an angle `position * inv_freq[i]`, so the dot
    product q·k depends only on the distance between the two positions. Positions are given per
    token, which is what lets one batch mix left-padded rows, packed sequences and decode steps.

    The inverse frequencies come from the config: the default schedule `theta ** (-2i / d)` is
    written here; scaled variants (llama3, yarn, ...) are taken from `transformers`' own table.
    """

    def __init__(self, config):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        head_dim = head_dim_of(config)
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[...]` (int) -> cos, sin `[..., rotary_dim]` in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, T, num_heads, head_dim]`, cos/sin `[B, T, rotary_dim]` -> rotated x, same shape."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k (skipped when the weights are None), then the rotation of both.

    q `[B, T, num_heads, head_dim]`, k `[B, T, num_kv_heads, head_dim]`, cos/sin `[B, T, rotary_dim]`.
    One function so that `fused` compiles the four elementwise passes together (vLLM fuses the q/k norm and
    the rotary embedding the same way).
    """
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def norm_rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`norm_and_rotate`, then the K/V write of a paged backend (`minirt.attention.store_kv`) of the rotated k and
    of v: returns the rotated q. The contract of `DecoderAttention.rotary_store` (chapter 07), in plain torch.

    q `[1, T, H, D]`, k/v `[1, T, Hkv, D]` (a packed batch), k_cache/v_cache `[num_blocks, block_size, Hkv, D]`,
    slot_mapping `[T]`. `minirt.kernels.rotary_triton.norm_rotate_and_store_triton` does it in one kernel.
    """
    from minirt.attention import store_kv

    q, k = norm_and_rotate(q, k, cos, sin, q_weight, k_weight, eps)
    store_kv(k_cache, v_cache, k[0], v[0], slot_mapping)
    return q


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   silu_and_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   residual: torch.Tensor | None = None):
    """The contract of a `Linear.gemv` kernel, in plain torch: `F.linear(x, weight, bias)`, or with
    `silu_and_mul` (weight a merged gate/up projection `[2 * I, K]`) `silu(gate) * up` `[..., I]`.
    With `norm_weight` `[K]` the RMSNorm before the projection comes first, on the stream `s = residual + x`
    (`x` when residual is None), and the result is `(out, s)`: `DecoderLayer.forward_one_row`'s prologue.
    `minirt.kernels.gemv_triton.linear_gemv` does the same for one row in one kernel."""
    if norm_weight is not None:
        stream = x if residual is None else residual + x
        return gemv_reference(rms_norm(stream, norm_weight, eps), weight, bias, silu_and_mul=silu_and_mul), stream
    y = F.linear(x, weight, bias)
    if not silu_and_mul:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose one-row inputs can go to a matrix-vector
    kernel instead of cuBLAS: `gemv` is None (always `F.linear`) or a function with `gemv_reference`'s
    contract for one row, such as `minirt.kernels.gemv_triton.linear_gemv` (chapter 07, `EngineConfig.gemv`).
    That contract includes `silu_and_mul=True`, which `GatedMLP` passes for its merged gate/up, and the norm
    prologue (`norm_weight`, `eps`, `residual`) that `DecoderLayer.forward_one_row` asks for: a plain `F.linear`
    no longer fits as a hook. `merge_linears` keeps the setting of the first layer it merges.
    """

    gemv = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[:-1].numel() == 1:     # one row: a batch-1 decode step
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def merge_linears(*linears: nn.Linear) -> Linear:
    """One `Linear` whose output is the outputs of `linears` side by side: one GEMM instead of several.

    Every projection of a decode step is a matrix-vector product that reads its weight once; small ones
    cost a kernel launch and a wave of thread blocks each, whatever their size. vLLM loads q/k/v into one
    `QKVParallelLinear` and gate/up into one `MergedColumnParallelLinear` for the same reason.
    """
    first = linears[0]
    has_bias = first.bias is not None
    merged = Linear(first.in_features, sum(m.out_features for m in linears), bias=has_bias,
                    device=first.weight.device, dtype=first.weight.dtype)
    merged.gemv = getattr(first, "gemv", None)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([m.weight for m in linears]))
        if has_bias:
            merged.bias.copy_(torch.cat([m.bias for m in linears]))
    return merged


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer"):
    `down(act(gate(x)) * up(x))`. `[..., hidden] -> [..., hidden]`. `fuse = True`: act and product in one kernel."""

    fuse = False

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: only 'silu' is supported, got {hidden_act!r}")
        self.gate_up_proj = None      # set by merge_projections (chapter 07)

    def merge_projections(self) -> None:
        """Replace gate_proj and up_proj by one `gate_up_proj` (see `merge_linears`)."""
        self.gate_up_proj = merge_linears(self.gate_proj, self.up_proj)
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused(silu_and_mul) if self.fuse else silu_and_mul
        proj = self.gate_up_proj
        if proj is None:
            return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))
        if proj.gemv is not None and x.shape[:-1].numel() == 1:    # one row: the product in the GEMV's epilogue
            return self.down_proj(proj.gemv(x, proj.weight, proj.bias, silu_and_mul=True))
        return self.down_proj(act(*proj(x).chunk(2, dim=-1)))
