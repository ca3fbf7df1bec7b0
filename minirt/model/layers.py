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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x**2) + eps) * weight` over the last dim, in float32 and cast back, as Llama and Qwen do."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual addition and the next norm in one pass: `(rms_norm(s), s)` with `s = residual + x`.

    The layout of vLLM's and nano-vllm's models (`fused_add_rms_norm`): the residual stream is carried beside
    each sublayer's output and added inside the next norm, the same sums as `x = x + sublayer(norm(x))`.
    """
    x = residual + x
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

    `forward(x)`: `y = x / sqrt(mean(x**2) + eps) * weight` (see `rms_norm`), `[..., hidden_size]` in and out.
    `forward(x, residual)`: adds `x` into the residual stream first and returns `(y, new residual)`
    (see `add_rms_norm`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


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


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer"):
    `down(silu(gate(x)) * up(x))`. `[..., hidden] -> [..., hidden]`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: only 'silu' is supported, got {hidden_act!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
