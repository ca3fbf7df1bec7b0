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

import functools
from typing import Callable

import torch
from torch import nn

from minirt.attention import CausalAttention, PagedAttention
from minirt.model.layers import (GatedMLP, Linear, RMSNorm, RotaryEmbedding, fused, head_dim_of, merge_linears,
                                 norm_and_rotate)

#: model_type -> (qkv_bias, qk_norm); `None` means "read config.attention_bias".
SUPPORTED_ARCHITECTURES = {"qwen3": (None, True), "qwen2": (True, False), "llama": (None, False)}

AttentionBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderAttention(nn.Module):
    fuse = False            # True: q/k norm and rotation run compiled (`minirt.model.layers.fused`)
    rotary_kernel = None    # or a function with `norm_and_rotate`'s contract, used instead (chapter 07)
    rotary_store = None     # or one with `norm_rotate_and_store`'s: it also writes K/V into a paged cache (chapter 07)

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        h, d = config.hidden_size, self.head_dim
        self.q_proj = Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        # Qwen2 biases q/k/v only; Llama and Qwen3 put `attention_bias` on all four projections.
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.o_proj = Linear(self.num_heads * d, h, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv_proj = None          # set by merge_projections (chapter 07)

    def merge_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one `qkv_proj` (see `minirt.model.layers.merge_linears`)."""
        self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        self.q_proj = self.k_proj = self.v_proj = None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.attend(*self.project_qkv(x), cos, sin, attn)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: AttentionBackend) -> torch.Tensor:
        """Everything after the q/k/v projection: q/k norm, rotation, attention, o_proj. q/k/v `[B, T, heads * D]`."""
        B, T, _ = q.shape
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        norm_weights = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        if self.rotary_store is not None and isinstance(attn, PagedAttention):    # K/V written by the rotation
            q = self.rotary_store(q, k, v, cos, sin, *norm_weights, *attn.kv_cache[self.layer_idx],
                                  attn.meta.slot_mapping)
            out = attn.attend(self.layer_idx, q)
        else:
            rotate = self.rotary_kernel or (fused(norm_and_rotate) if self.fuse else norm_and_rotate)
            q, k = rotate(q, k, cos, sin, *norm_weights)
            out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    norm_in_gemv = False    # True: one-row inputs take `forward_one_row` (chapter 07; see `DecoderModel.set_norm_in_gemv`)

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

        Each residual addition happens inside the next norm (`RMSNorm.forward(x, residual)`), vLLM's layout:
        the same sums as `x = x + attn(norm(x)); x = x + mlp(norm(x))`, in fewer passes over memory.
        """
        if self.norm_in_gemv and x.shape[:-1].numel() == 1:
            return self.forward_one_row(x, residual, cos, sin, attn)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_one_row(self, x, residual, cos, sin, attn):
        """`forward` for one token (a batch-1 decode step) with each norm, and the residual addition before it,
        in the prologue of the GEMV that follows it: the merged q/k/v projection and the merged gate/up (with
        SiLU-and-multiply in its epilogue). Same arguments and sums; two kernels fewer per layer. Needs merged
        projections and a `gemv` hook with `gemv_reference`'s norm prologue (`minirt.kernels.gemv_triton`).
        """
        norm, qkv = self.input_layernorm, self.self_attn.qkv_proj
        out, residual = qkv.gemv(x, qkv.weight, qkv.bias, norm_weight=norm.weight, eps=norm.eps, residual=residual)
        x = self.self_attn.attend(*out.split(self.self_attn.qkv_sizes, dim=-1), cos, sin, attn)
        norm, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        act, residual = gate_up.gemv(x, gate_up.weight, gate_up.bias, silu_and_mul=True,
                                     norm_weight=norm.weight, eps=norm.eps, residual=residual)
        return self.mlp.down_proj(act), residual


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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
        x = self.model.embed_tokens(input_ids)    # no PDL: earlier steps' K/V is final (paged_attention_triton)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def set_fused_ops(self, enabled: bool) -> None:
        """Run the norms (with their residual additions), the rotation and SiLU-and-multiply as compiled kernels
        (True) or op by op (False).
        Same functions either way; see `minirt.model.layers.fused`."""
        for module in self.modules():
            if hasattr(type(module), "fuse"):
                module.fuse = enabled

    def set_gemv(self, gemv) -> None:
        """Send one-row inputs of every projection and of the LM head to `gemv` (a function with
        `minirt.model.layers.gemv_reference`'s contract, e.g. `minirt.kernels.gemv_triton.linear_gemv`), or back
        to `F.linear` (None, which also turns `set_norm_in_gemv` off: the norm prologue lives in the GEMV kernel).
        See `minirt.model.layers.Linear`."""
        if gemv is None:
            self.set_norm_in_gemv(False)
        for module in self.modules():
            if isinstance(module, Linear):
                module.gemv = gemv

    def set_rotary_kernel(self, kernel) -> None:
        """Run every layer's q/k norm and rotation with `kernel` (a function with
        `minirt.model.layers.norm_and_rotate`'s contract, e.g. `minirt.kernels.rotary_triton.norm_and_rotate_triton`)
        or, with None, as `norm_and_rotate` (compiled when `set_fused_ops(True)`)."""
        for layer in self.model.layers:
            layer.self_attn.rotary_kernel = kernel

    def set_rotary_store(self, kernel) -> None:
        """With a paged attention backend (`minirt.attention.PagedAttention`), run every layer's q/k norm, rotation
        and K/V write with `kernel` (a function with `minirt.model.layers.norm_rotate_and_store`'s contract, e.g.
        `minirt.kernels.rotary_triton.norm_rotate_and_store_triton`), and the backend's attention alone; None: the
        rotation (`set_rotary_kernel`), then the backend's write and attention. Other backends ignore it."""
        for layer in self.model.layers:
            layer.self_attn.rotary_store = kernel

    def set_norm_in_gemv(self, enabled: bool) -> None:
        """Run each layer's two norms in the prologue of the GEMV after them when a step has one token
        (`DecoderLayer.forward_one_row`), or as their own kernels (False). Raises ValueError if enabled without
        merged projections (`merge_projections`) and a `gemv` hook (`set_gemv`), which the prologue lives in."""
        if enabled and any(layer.self_attn.qkv_proj is None or layer.self_attn.qkv_proj.gemv is None
                           for layer in self.model.layers):
            raise ValueError("norm_in_gemv: needs merged projections and a gemv kernel (merge_projections, set_gemv)")
        for layer in self.model.layers:
            layer.norm_in_gemv = enabled

    def prefetch_next_weights(self, table, ahead: int = 1, count: int = 1) -> None:
        """Have every one-row GEMV ask the L2 cache for the weights of the GEMV after it in a decode step: q/k/v
        for o_proj, o_proj for gate/up, gate/up for down, down for the next layer's q/k/v (more generally, for the
        `count` GEMVs from the `ahead`-th one after it on). `table` (e.g.
        `minirt.kernels.gemv_triton.l2_prefetch_table`) turns a list of weights into the `l2_prefetch` argument
        that is bound into each projection's `gemv` hook. At batch 1 each GEMV reads its weights at about
        half the memory bandwidth; the next weights then stream in beside them, and the next GEMV starts on L2
        hits. On an H200, prefetching further ahead or more was slower (`benchmarks/l2_prefetch.py`, chapter 07).
        Needs merged projections and gemv hooks without a prefetch bound yet (`merge_projections`, `set_gemv`, which
        undoes this). Raises ValueError naming l2_prefetch, ahead or count otherwise."""
        for name, value in (("ahead", ahead), ("count", count)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        chain = [proj for layer in self.model.layers for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(proj is None or proj.gemv is None for proj in chain):
            raise ValueError("l2_prefetch: needs merged projections and a gemv kernel (merge_projections, set_gemv)")
        if any("l2_prefetch" in getattr(proj.gemv, "keywords", {}) for proj in chain):
            raise ValueError("l2_prefetch: the gemv hooks already ask for a prefetch; set_gemv undoes it")
        for i, proj in enumerate(chain):
            if after := chain[i + ahead:i + ahead + count]:
                proj.gemv = functools.partial(proj.gemv, l2_prefetch=table([p.weight for p in after]))

    def merge_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer (see `minirt.model.layers.merge_linears`).
        For serving only: afterwards the parameter names no longer match the checkpoint's."""
        for layer in self.model.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.merge_projections()
                layer.mlp.merge_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
