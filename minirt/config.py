"""Engine settings, declared once: `LLM(**settings)` -> `Engine(**settings)` -> `EngineConfig(**settings)`.

Each value is checked here on its own (type and range); a bad one fails at construction with the field's name
and its limit, and so does a name that is not a setting. Which speed switches can run together, and on which
device, is decided in one place: the rules of `minirt.fast.plan`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
QUANTIZATION_METHODS = (None, "int8", "fp8")
SPECULATIVE_METHODS = (None, "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16

#: Switches that are True, False or None (None: on where the rules of `minirt.fast.plan` say it pays).
AUTO_SWITCHES = ("fused_ops", "merge_projections", "gemv", "norm_in_gemv", "rotary_kernel", "pdl",
                 "kv_write_in_rotary", "combine_in_attention", "prefetch_kv", "l2_prefetch", "overlap_scheduling",
                 "piecewise_graphs", "async_scheduling", "silu_and_mul_kernel", "rotary_cache", "argmax_in_gemv",
                 "verify_graphs")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(kw_only=True)
class EngineConfig:
    """The settings of `minirt.LLM` and `minirt.Engine` (names as in vLLM).

    The engine (chapters 03-06):
    device: "cpu", "cuda[:index]" or None (CUDA when available). dtype: a floating `torch.dtype` or its name;
    None = float32 on the CPU, bfloat16 on a GPU.
    block_size: token slots per KV block. num_kv_blocks: blocks in the pool (None = sized from memory).
    max_num_seqs: requests admitted at once (prefilling + running).
    max_num_batched_tokens: the per-step token budget, decodes and prefill chunks together.
    max_prefill_chunk: the most prompt tokens one request may prefill in one step.
    max_model_len: prompt + max_new_tokens limit (None = the model's max_position_embeddings).
    enable_prefix_caching: share full KV blocks between requests with equal prefixes.

    Chapter 07's speed switches, resolved into a `minirt.fast.Plan` by `minirt.fast.resolve_plan` (its table
    `RULES` says what each needs and where None turns it on; `engine.plan` holds what runs):
    attention_backend: "auto", "torch" (`minirt.attention.paged_attention_reference`), "triton"
    (`minirt.kernels.paged_attention_triton`) or "flash_attn" (the flash-attn package, `minirt.fast.flash_attn`). split_kv: let small decode batches share a sequence's keys among
    several programs of the Triton kernel (flash-decoding). enforce_eager: never capture CUDA graphs.
    fused_ops: norms, the rotation and SiLU-and-multiply compiled by `torch.compile`. merge_projections: one GEMM
    for q/k/v and one for gate/up. gemv: one-row products through the Triton matrix-vector kernel.
    num_scheduler_steps: decode steps run back to back per schedule (vLLM's multi-step scheduling).
    norm_in_gemv: each layer's norms in the prologue of the GEMV after them. rotary_kernel: the q/k norm and the
    rotation in one Triton kernel. pdl: programmatic dependent launch of the Triton kernels (Hopper or later).
    kv_write_in_rotary: the K/V cache write inside the rotary kernel. combine_in_attention: the split-KV combine
    inside the attention kernel. prefetch_kv: split-KV attention loads earlier steps' K/V before its PDL wait.
    l2_prefetch: each one-row GEMV asks the L2 cache for the next GEMV's weights. overlap_scheduling: with
    multi-step decode, the next burst of the same requests is launched before the host takes this one's tokens.
    piecewise_graphs: steps with prefill chunks replay CUDA graphs cut at each attention call, attention launched
    between the pieces. async_scheduling: a step with prefill chunks is scheduled and launched before the host takes
    the tokens of the one before (their rows read them on the device); None: with piecewise graphs.
    silu_and_mul_kernel: SwiGLU's SiLU-and-multiply by a Triton kernel (in place of the compiled or eager one).
    rotary_cache: each step's cos and sin looked up per position in a table filled once (vLLM's cos_sin_cache), not
    computed. argmax_in_gemv: a greedy one-row step's argmax taken in the LM head GEMV's epilogue, the logits never
    written.

    Chapter 10 (`minirt.quant`): quantization: None (the checkpoint's own weights; a pre-quantized FP8 checkpoint
    loads by its `quantization_config`), "int8" or "fp8" (e4m3): the linear layers' weights quantized at load,
    symmetric, weight-only. weight_block_size: None (one scale per output channel) or B (one scale per B x B block,
    the FP8 checkpoints' layout with B = 128).

    Chapter 11 (`minirt.spec`): speculative: None, "ngram" (prompt lookup: the draft is what followed the last
    n-gram's earlier occurrence) or "draft" (a small model of the same tokenizer). num_speculative_tokens: k, the
    tokens drafted per step (None: 4 where speculative is set). speculative_model: the draft model's checkpoint
    (None: the one shipped beside the default model). prompt_lookup_min, prompt_lookup_max: the n-gram lengths the
    "ngram" drafter tries, longest first (vLLM's names). verify_graphs: verification steps (k + 1 rows per running
    request, no prefill chunk) replay CUDA graphs captured for them (None: off; True needs speculative decoding and CUDA graphs with the Triton
    attention kernel).
    """

    device: object = None
    dtype: object = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # chapter 07
    attention_backend: str = "auto"
    split_kv: bool = True
    enforce_eager: bool = False
    fused_ops: bool | None = None
    merge_projections: bool | None = None
    gemv: bool | None = None
    num_scheduler_steps: int | None = None
    norm_in_gemv: bool | None = None
    rotary_kernel: bool | None = None
    pdl: bool | None = None
    kv_write_in_rotary: bool | None = None
    combine_in_attention: bool | None = False
    prefetch_kv: bool | None = None
    l2_prefetch: bool | None = None
    overlap_scheduling: bool | None = None
    piecewise_graphs: bool | None = None
    async_scheduling: bool | None = None
    silu_and_mul_kernel: bool | None = None
    rotary_cache: bool | None = None
    argmax_in_gemv: bool | None = None
    # chapter 09: processes the model is sharded over (`minirt.parallel`; 1: this process only)
    tensor_parallel_size: int = 1
    # chapter 10
    quantization: str | None = None
    weight_block_size: int | None = None
    # chapter 11
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: object = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    verify_graphs: bool | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_scheduler_steps", "weight_block_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}: must be an integer >= 1 or None, got {value!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative: must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        k = self.num_speculative_tokens
        if k is not None:
            if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens: must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or "
                                 f"None, got {k!r}")
            if self.speculative is None:
                raise ValueError("num_speculative_tokens: set, but speculative is None (choose 'ngram' or 'draft')")
        if self.speculative_model is not None and self.speculative != "draft":
            raise ValueError(f"speculative_model: set, but speculative is {self.speculative!r} (it needs 'draft')")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max = "
                             f"{self.prompt_lookup_max}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("enable_prefix_caching", "split_kv", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        for name in AUTO_SWITCHES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: must be a bool or None (None = where it pays; see minirt.fast.plan), "
                                 f"got {value!r}")

    @classmethod
    def from_settings(cls, settings: dict) -> "EngineConfig":
        """`EngineConfig(**settings)`, refusing a name that is not a setting with a ValueError that names it (and
        the nearest setting, for a misspelling)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in settings:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"the settings are {', '.join(names)}"
                raise ValueError(f"{name}: not an engine setting ({hint})")
        return cls(**settings)


def takes_settings(init):
    """Decorate an `__init__(self, model, **settings)` so that its signature lists `EngineConfig`'s fields as
    keyword-only parameters with their defaults: what `help()`, `inspect.signature` and Jupyter's tooltips show.
    The settings are still checked by `EngineConfig.from_settings`, the one place they are declared."""
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(EngineConfig)]
    init.__signature__ = signature.replace(parameters=params)
    return init


def cdiv(a: int, b: int) -> int:
    return -(a // -b)
