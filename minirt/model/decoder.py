"""One decoder-only transformer for the Qwen3, Qwen2 and Llama families.

The three families share one block: pre-norm attention with rotary positions and grouped-query
attention, then a pre-norm SwiGLU MLP. They differ in two switches, read from the HF config:

* Qwen2 puts a bias on the q/k/v projections (`qkv_bias`);
* Qwen3 normalizes each head of q and k with an RMSNorm before the rotation (`qk_norm`).

Parameter names equal those of `transformers`' checkpoints (`model.layers.0.self_attn.q_proj.weight`,
...), so a safetensors file loads with a plain `load_state_dict`. Structure as in nano-vllm's
`models/qwen3.py` and `transformers`' `modeling_qwen3.py`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from minirt.attention import CausalAttention
from minirt.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, head_dim_of

#: model_type -> (qkv_bias, qk_norm); `None` means "read config.attention_bias".
SUPPORTED_ARCHITECTURES = {"qwen3": (None, True), "qwen2": (True, False), "llama": (None, False)}

AttentionBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderAttention(nn.Module):
    """Grouped-query self-attention with rotary positions: `[B, T, hidden]` -> `[B, T, hidden]`.

    Where earlier tokens' keys and values come from is the attention backend's business (`minirt.attention`).
    """

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        # Qwen2 biases q/k/v only; Llama and Qwen3 put `attention_bias` on all four projections.
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:                     # Qwen3: an RMSNorm over each head of q and k, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)                     # [B, T, num_heads, head_dim]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, x, residual, cos, sin, attn):
        """`x`: the previous layer's MLP output, not yet added to `residual`, the residual stream (None before
        the first layer, where `x` is the embedding). Returns this layer's MLP output and the stream.

        Each residual addition happens inside the next norm (`RMSNorm.forward(x, residual)`), as in vLLM's and
        nano-vllm's models: the same sums as `x = x + attn(norm(x)); x = x + mlp(norm(x))`.
        """
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    """Embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, qk_norm) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DecoderModel(nn.Module):
    """A causal language model: token ids -> hidden states -> logits.

    `forward(input_ids, positions, attn=None)`:
        input_ids, positions `[B, T]` int64 -> hidden states `[B, T, hidden_size]`.
        `attn` is the attention backend (see `minirt.attention`); None means plain causal attention
        over the given tokens, with no cache.
    `compute_logits(hidden)`: `[..., hidden_size]` -> float32 `[..., vocab_size]`. Kept separate so
    engines project only the rows they sample from (the last token of each sequence).
    """

    def __init__(self, config):
        super().__init__()
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type: {config.model_type!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[config.model_type]
        if qkv_bias is None:
            qkv_bias = bool(getattr(config, "attention_bias", False))
        self.config = config
        self.model = DecoderBody(config, qkv_bias, qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        if attn is None:
            attn = CausalAttention()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
