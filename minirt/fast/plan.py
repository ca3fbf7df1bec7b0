"""Every speed switch resolved once, into a frozen `Plan`, by one table of rules.

`resolve_plan(config, device, model_config)` walks `RULES` in order. For each switch it asks what the switch
needs that this machine or the switches before it do not give (`Rule.needs`): asked for (True) and something
missing, it raises ValueError naming the switch and what is missing; None turns it on where nothing is missing
and `Rule.auto` says it pays; False keeps it off. The result says what runs, and it is the only place that says
so: the engine builds from it, and `bench`, chapter 07 and the JSON reports read it (`engine.plan`).

Chapter 10's quantization is a value, not a switch: `resolve_quantization` reads it first (from the settings, or
from a pre-quantized checkpoint's `quantization_config`), and the rows of the switches that rewrite the linear
layers need float weights.

mini-sglang resolves its "auto" settings the same way, once, into a frozen config (`_adjust_config`); vLLM picks
each op's implementation once when it is built (`CustomOp`). Adding an optimization is one module in
`minirt.fast` and one row here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from minirt.config import EngineConfig
from minirt.kernels import pdl_missing, triton_missing


@dataclass(frozen=True)
class Hardware:
    """What this machine lacks for each family of fast kernels (each entry a phrase; empty: it can run).

    triton: for any Triton kernel (a CUDA device, Triton installed). head_dim: for the Triton attention and rotary
    kernels, which also need a power-of-two head_dim >= 16. pdl: for programmatic dependent launch and the bulk
    L2 prefetch (compute capability 9.0 or later, a Triton with `gdc_wait`). flash_attn: for
    `attention_backend="flash_attn"` with this dtype, head_dim and block_size (`minirt.fast.flash_attn`).
    """

    device_type: str
    triton: tuple[str, ...] = ()
    head_dim: tuple[str, ...] = ()
    pdl: tuple[str, ...] = ()
    flash_attn: tuple[str, ...] = ()

    @classmethod
    def of(cls, device: torch.device, head_dim: int, dtype: torch.dtype | str | None = None, block_size: int = 16,
           flash_attn: bool = True) -> "Hardware":
        """What `device` lacks for a model of this head_dim run in `dtype` (None: the engine's default for the
        device) with KV blocks of block_size tokens. flash_attn=False does not look for flash-attn (importing
        flash-attn-4 takes seconds) and marks it missing."""
        from minirt.fast.flash_attn import flash_attn_missing
        from minirt.model.loader import resolve_dtype

        triton = tuple(triton_missing(device))
        flash = (flash_attn_missing(device, head_dim, resolve_dtype(dtype, device), block_size) if flash_attn
                 else ["attention_backend='flash_attn' (not looked for)"])
        return cls(device.type, triton, tuple(triton_missing(device, head_dim)[len(triton):]), pdl_missing(device),
                   tuple(flash))


@dataclass(frozen=True)
class Plan:
    """What runs: every switch of `EngineConfig`'s chapter-07 section, resolved (see `RULES`).

    attention_backend: "torch", "triton" or "flash_attn". cuda_graphs: decode steps replay CUDA graphs
    (`enforce_eager` off and possible). num_scheduler_steps: decode steps per schedule (1: single steps). The others: on or off.
    quant_gemv: quantized linears through `minirt.fast.quant_layers.FastQuantizedLinear` (few rows: the Triton
    `quant_gemv`; more: FP8 tensor-core GEMMs or dequantize-then-GEMM). Chapter 10's: quantization: None (float weights), "int8" or "fp8", as asked or as the checkpoint's
    `quantization_config` says; weight_block_size: None (per output channel) or B (B x B blocks) (`minirt.quant`).
    Chapter 11's (`minirt.spec`): speculative: the drafter's name or None; num_speculative_tokens: k;
    speculative_max_batch: the running batch above which a step drafts nothing; verify_graphs: verification steps
    (k + 1 rows per running request, no prefill chunk) replay CUDA graphs (`minirt.fast.runner.build_verify_graphs`).
    The other switches resolve as without speculation, and the steps that draft nothing run them all, overlap and
    async scheduling included.
    """

    attention_backend: str = "torch"
    split_kv: bool = False
    cuda_graphs: bool = False
    fused_ops: bool = False
    merge_projections: bool = False
    gemv: bool = False
    num_scheduler_steps: int = 1
    norm_in_gemv: bool = False
    rotary_kernel: bool = False
    pdl: bool = False
    kv_write_in_rotary: bool = False
    combine_in_attention: bool = False
    prefetch_kv: bool = False
    l2_prefetch: bool = False
    overlap_scheduling: bool = False
    piecewise_graphs: bool = False
    async_scheduling: bool = False
    silu_and_mul_kernel: bool = False
    rotary_cache: bool = False
    argmax_in_gemv: bool = False
    quant_gemv: bool = False
    quantization: str | None = None
    weight_block_size: int | None = None
    # chapter 11 (`minirt.spec`): the drafter (None: no speculation), k, the running batch above which a step
    # drafts nothing (decoding that many rows is no longer bound by reading the weights: verifying costs more), and
    # whether verification steps replay CUDA graphs
    speculative: str | None = None
    num_speculative_tokens: int = 0
    speculative_max_batch: int = 0
    verify_graphs: bool = False

    @property
    def is_reference(self) -> bool:
        """True when nothing of chapter 07 runs: the model and its runner are the chapters 00-06 reference (and so is
        the engine, unless `speculative` is set: then chapter 11's scheduler and step run over them)."""
        return dataclasses.replace(self, speculative=None, num_speculative_tokens=0, speculative_max_batch=0) == Plan()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Resolution:
    """The switches resolved so far, and why each one that is off is off."""

    def __init__(self, hw: Hardware, tensor_parallel_size: int = 1, quantization: str | None = None,
                 weight_block_size: int | None = None):
        self.hw = hw
        self.tensor_parallel_size = tensor_parallel_size
        self.quantization, self.weight_block_size = quantization, weight_block_size
        self.on: dict[str, bool | int] = {}
        self.why_off: dict[str, str] = {}

    def need(self, *names: str) -> list[str]:
        """The switches among `names` that resolved off, each with the reason."""
        return [_Off(RULE_BY_NAME[n].label or n, self.why_off[n]) for n in names if not self.on[n]]


class _Off(str):
    """A switch that is needed and off, as a message names it: "label (off: why)"; `.label` alone."""

    def __new__(cls, label: str, why: str):
        text = super().__new__(cls, f"{label} (off: {why})")
        text.label = label
        return text


@dataclass(frozen=True)
class Rule:
    """One row of the table. name: the `Plan` field. field: the `EngineConfig` field that asks for it (default:
    name). what: the switch in words, for messages. needs: what it needs and lacks (phrases; empty: it can run).
    auto: what None resolves to where nothing is missing. when: `auto` in words. label: how a dependent's
    message names it. asked: turns the config value into True (asked on), False (asked off) or None (auto);
    None: the value is that already (or, for num_scheduler_steps, a number)."""

    name: str
    what: str
    needs: Callable[[_Resolution], list[str]]
    auto: Callable[[_Resolution], bool | int]
    when: str
    field: str = ""
    label: str = ""
    asked: Callable[[object], object] | None = None

    def config_field(self) -> str:
        return self.field or self.name


def _cuda(r: _Resolution) -> bool:
    return r.hw.device_type == "cuda"


def _graphs(r: _Resolution) -> bool:
    return bool(r.on["cuda_graphs"])


def _graph_kernel(r: _Resolution) -> list[str]:
    """What CUDA graphs lack in the attention kernel: flash-attn's and the Triton kernel can be captured."""
    return [] if r.on["flash_attn"] else r.need("attention_backend")


def _one_process(r: _Resolution) -> list[str]:
    """What a switch that chapter 09's tensor-parallel runner cannot run lacks under it."""
    tp = r.tensor_parallel_size
    return [] if tp == 1 else [f"tensor_parallel_size=1 (got {tp}: the ranks run no graphs, GEMVs or bursts)"]


def _gemv_weights(r: _Resolution) -> list[str]:
    """What a fusion built around the float GEMV kernel (`minirt.fast.layers.GemvLinear`) lacks under quantized
    weights: one scale per output channel, which that kernel applies (`linear_gemv(weight_scale=...)`; block scales
    go to `quant_gemv`), and the quantized linears' kernels."""
    if r.quantization is None:
        return []
    if r.weight_block_size is not None:
        b = r.weight_block_size
        return [f"float weights or one scale per output channel (got {b} x {b} scale blocks)"]
    return r.need("quant_gemv")


def _quantized(r: _Resolution) -> list[str]:
    """What the quantized linears' kernels lack with float weights: weights to dequantize."""
    return [] if r.quantization is not None else ["quantized weights (quantization=None and a float checkpoint)"]


def _bursts(r: _Resolution) -> list[str]:
    """What overlap scheduling lacks: bursts of decode steps to overlap (multi-step decode)."""
    if _more_than_one(r.on["num_scheduler_steps"]):
        return []
    return [_Off("num_scheduler_steps > 1", r.why_off["num_scheduler_steps"])]


def _speculation_in_one_process(r: _Resolution) -> list[str]:
    """What speculative decoding lacks under chapter 09's tensor-parallel runner (its ranks run single-token steps
    with no verification rows and no rollback)."""
    tp = r.tensor_parallel_size
    return [] if tp == 1 else [f"tensor_parallel_size=1 (got {tp}: the ranks verify no drafts)"]


#: Speculation drafts only while the running batch times k+1 stays within this many tokens per step: below it a
#: step's time is the weights' read, nearly the same for k+1 rows as for one; above it the rows' compute takes
#: over (a GEMM over ~128+ rows of a 0.6B model on the H200), and each rejected row is time lost (vLLM's
#: `disable_by_batch_size` turns speculation off by batch size the same way).
SPECULATIVE_MAX_TOKENS = 128


RULES: tuple[Rule, ...] = (
    # attention_backend is one field and two rows: "flash_attn" (minirt.fast.flash_attn), then "triton".
    # auto keeps minirt's Triton kernel: with split-KV it decodes faster than flash-attn-4, which has no split-KV
    # on Hopper; flash-attn-4 is faster on prefill chunks of 256 tokens and more, a per-phase choice not built yet
    # (benchmarks/README.md, "flash-attn against minirt's kernel").
    Rule("flash_attn", "'flash_attn'", lambda r: list(r.hw.flash_attn), lambda r: False,
         "never (asked for by name only)", field="attention_backend",
         label="attention_backend='flash_attn'", asked=lambda v: True if v == "flash_attn" else False),
    Rule("attention_backend", "'triton'", lambda r: [*r.hw.triton, *r.hw.head_dim], lambda r: True,
         "where the Triton kernel can run", label="attention_backend='triton'",
         asked=lambda v: {"auto": None, "triton": True, "torch": False, "flash_attn": False}[v]),
    Rule("split_kv", "split-KV decode", lambda r: r.need("attention_backend"), lambda r: True,
         "with the Triton attention kernel", asked=lambda v: None if v else False),
    Rule("cuda_graphs", "CUDA graphs", lambda r: ([] if _cuda(r) else [f"a CUDA device (got {r.hw.device_type})"])
         + _graph_kernel(r) + _one_process(r), lambda r: True, "on CUDA with the Triton or flash-attn kernel",
         field="enforce_eager", label="CUDA graphs", asked=lambda v: False if v else None),
    Rule("fused_ops", "torch.compile-fused ops", lambda r: list(r.hw.triton) if _cuda(r) else [], _cuda,
         "on CUDA"),                                      # Inductor writes Triton kernels for CUDA tensors
    # Quantized q/k/v and gate/up merge too (`minirt.fast.quant_layers.merge_quantized`); the GEMV kernel runs the
    # float linears that stay under quantization (the LM head), `quant_gemv` the quantized ones.
    Rule("merge_projections", "merged projections", lambda r: [], _cuda, "on CUDA"),
    Rule("gemv", "the Triton matrix-vector kernel", lambda r: [*r.hw.triton, *_one_process(r)], _graphs,
         "with CUDA graphs"),
    # Follows gemv off; on wherever quantized weights run on CUDA, graphs or not: their reference dequantizes the
    # whole weight at every call (`minirt.fast.quant_layers.FastQuantizedLinear`).
    Rule("quant_gemv", "the quantized GEMV kernel and FP8 GEMMs",
         lambda r: [*r.hw.triton, *_one_process(r), *_quantized(r)],
         lambda r: _cuda(r), "on CUDA with quantized weights", field="gemv",
         asked=lambda v: False if v is False else None),
    # Chapter 11. The plan's `speculative` holds the drafter's name; verification steps (k+1 rows per request) replay
    # graphs of their own with verify_graphs (the last row), steps with prefill chunks the piecewise graphs, and steps
    # without drafts the decode graphs.
    Rule("speculative", "speculative decoding", _speculation_in_one_process, lambda r: False, "never (asked for by name only)",
         asked=lambda v: v is not None),
    Rule("num_speculative_tokens", "draft tokens", lambda r: r.need("speculative"),
         lambda r: 4, "4 with speculative decoding"),
    Rule("speculative_max_batch", "drafting", lambda r: r.need("speculative"),
         lambda r: max(1, SPECULATIVE_MAX_TOKENS // (r.on["num_speculative_tokens"] + 1)),
         f"while the running batch x (k+1) <= {SPECULATIVE_MAX_TOKENS} tokens", field="speculative",
         asked=lambda v: None),
    # (with speculation, the steps that draft nothing run as without it: bursts, overlap and async scheduling)
    Rule("num_scheduler_steps", "multi-step decode", _one_process, lambda r: 8 if _graphs(r) else 1,
         "8 with CUDA graphs, else 1"),
    Rule("norm_in_gemv", "the GEMV's norm prologue",
         lambda r: [*r.need("gemv", "merge_projections"), *_gemv_weights(r)], lambda r: True,
         "with gemv and merged projections"),
    Rule("rotary_kernel", "the Triton kernel", lambda r: [*r.hw.triton, *r.hw.head_dim], _graphs,
         "with CUDA graphs"),
    Rule("pdl", "programmatic dependent launch", lambda r: list(r.hw.pdl), _graphs,
         "with CUDA graphs where it can run"),
    Rule("kv_write_in_rotary", "the K/V write in the rotary kernel", lambda r: r.need("rotary_kernel"),
         lambda r: True, "with the rotary kernel"),
    # Kept to show a fusion that loses: measured slower with PDL (1.08x batch-1 TPOT, every run); default off.
    Rule("combine_in_attention", "the split combine in the attention kernel",
         lambda r: r.need("attention_backend", "split_kv"), lambda r: False, "off (slower where PDL runs)"),
    Rule("prefetch_kv", "loading K/V before the PDL wait", lambda r: r.need("pdl", "split_kv", "attention_backend"),
         lambda r: True, "with PDL and split-KV Triton attention"),
    Rule("l2_prefetch", "the bulk prefetch into L2",
         lambda r: [*r.hw.pdl, *r.need("gemv", "merge_projections"), *_gemv_weights(r)],
         lambda r: bool(r.on["pdl"]), "with the GEMV kernel, merged projections and PDL"),
    # With speculation as without it: a drafting step (whose rows are known only from every token before it) first
    # takes what is in flight and launches nothing after it (`minirt.spec.engine`); the other steps overlap.
    Rule("overlap_scheduling", "launching the next burst before taking this one's tokens", _bursts, lambda r: True,
         "with multi-step decode"),
    Rule("piecewise_graphs", "piecewise CUDA graphs for steps with prefill chunks", lambda r: r.need("cuda_graphs"),
         lambda r: True, "with CUDA graphs"),
    # auto: on with piecewise graphs (benchmarks/results/h200/ab-async-scheduling.json: throughput and TTFT both
    # better, once the sampler no longer made each launch wait for the step it launched). With speculation as with
    # overlap scheduling: a drafting step takes the step in flight first.
    Rule("async_scheduling", "launching a step with prefill chunks before taking the tokens of the one before",
         _one_process, lambda r: bool(r.on["piecewise_graphs"]), "with piecewise CUDA graphs"),
    Rule("silu_and_mul_kernel", "the Triton SiLU-and-multiply kernel", lambda r: list(r.hw.triton), _cuda,
         "on CUDA where Triton runs"),
    Rule("rotary_cache", "cos and sin looked up per position", lambda r: [], _cuda, "on CUDA"),
    Rule("argmax_in_gemv", "the greedy argmax in the LM head GEMV's epilogue", lambda r: r.need("gemv"),
         lambda r: True, "with gemv"),
    # Chapter 11 again: a verification step of running requests only replays one CUDA graph of k + 1 rows per
    # request (`minirt.fast.runner.build_verify_graphs`); off, it takes the piecewise graphs. Triton's kernel only:
    # flash-attn's call for several rows per sequence (flash-attn 2's varlen kernel) is not captured anywhere here.
    # auto stays off: tested on the CPU (the graphs' static buffers run eagerly), but neither their capture nor what
    # they buy has been measured on a GPU (benchmarks/spec_verify.py measures it), so they are asked for by name.
    Rule("verify_graphs", "CUDA graphs for verification steps",
         lambda r: r.need("speculative", "cuda_graphs", "attention_backend"), lambda r: False,
         "never (asked for by name: not measured on a GPU)"),
)
RULE_BY_NAME = {rule.name: rule for rule in RULES}


def _more_than_one(asked) -> bool:
    """A number of steps above one asks for multi-step decode as True asks for a switch."""
    return isinstance(asked, int) and not isinstance(asked, bool) and asked > 1


def resolve_quantization(config: EngineConfig, model_config=None) -> tuple[str | None, int | None]:
    """`(quantization, weight_block_size)` that run: the settings' on a float checkpoint, the checkpoint's own
    (its `quantization_config`, `minirt.quant.model.checkpoint_quantization`) on a pre-quantized one, where the
    settings must leave them None or agree. Raises ValueError naming the field: a checkpoint's unknown
    quant_method; a quantization other than the checkpoint's (int8 asked on FP8 weights); a weight_block_size
    other than the checkpoint's; a weight_block_size with quantization None on a float checkpoint; quantized
    weights with tensor_parallel_size > 1 (chapter 09's ranks load float weights)."""
    asked, block = config.quantization, config.weight_block_size
    checkpoint = None
    if model_config is not None:
        from minirt.quant.model import checkpoint_quantization

        checkpoint = checkpoint_quantization(model_config)
    if checkpoint is None:
        if asked is None and block is not None:
            raise ValueError(f"weight_block_size: {block} set, but quantization is None and the checkpoint's weights "
                             "are float (choose quantization='int8' or 'fp8')")
        resolved = (asked, block)
    else:
        method, checkpoint_block = resolved = checkpoint
        if asked is not None and asked != method:
            raise ValueError(f"quantization: {asked!r} asked, but the checkpoint's weights are already {method} "
                             f"(its quantization_config); leave quantization None or {method!r}")
        if block is not None and block != checkpoint_block:
            raise ValueError(f"weight_block_size: {block} disagrees with the checkpoint's quantization_config."
                             f"weight_block_size ({checkpoint_block} x {checkpoint_block} blocks; None: one scale "
                             "per tensor); leave it None")
    if resolved[0] is not None and config.tensor_parallel_size > 1:
        raise ValueError(f"quantization: quantized weights need tensor_parallel_size=1 (got "
                         f"{config.tensor_parallel_size}: the ranks load float weights)")
    return resolved


def resolve_plan(config: EngineConfig, device: torch.device, model_config=None,
                 hardware: Hardware | None = None) -> Plan:
    """The `Plan` for these settings on `device` with this model (an HF config; its head_dim is what the Triton
    attention and rotary kernels check, its `quantization_config` what `resolve_quantization` reads).
    `hardware` overrides what `Hardware.of(device, head_dim)` finds (tests). Raises ValueError naming the switch
    and what it lacks for a switch asked for (True) that cannot run, and those `resolve_quantization` raises."""
    quantization, weight_block_size = resolve_quantization(config, model_config)
    if hardware is None:
        from minirt.model.layers import head_dim_of

        hardware = Hardware.of(device, head_dim_of(model_config) if model_config is not None else 16,
                               config.dtype, config.block_size, flash_attn=config.attention_backend == "flash_attn")
    r = _Resolution(hardware, config.tensor_parallel_size, quantization, weight_block_size)
    for rule in RULES:
        value = getattr(config, rule.config_field())
        asked = rule.asked(value) if rule.asked else value
        missing = rule.needs(r)
        if (asked is True or _more_than_one(asked)) and missing:
            raise ValueError(f"{rule.config_field()}: {rule.what} needs {' and '.join(missing)}")
        if asked is not None:                                   # True, False, or a number of steps
            r.on[rule.name] = asked
            r.why_off[rule.name] = f"{rule.config_field()}={value!r}"
        elif missing:                                           # a dependency is named, not why it is off
            r.on[rule.name] = False
            r.why_off[rule.name] = f"needs {' and '.join(getattr(m, 'label', m) for m in missing)}"
        else:
            r.on[rule.name] = rule.auto(r)
            r.why_off[rule.name] = f"{rule.config_field()}=None is on only {rule.when}"
    values = dict(r.on)
    flash = values.pop("flash_attn")
    values["attention_backend"] = "flash_attn" if flash else "triton" if values["attention_backend"] else "torch"
    values["num_scheduler_steps"] = int(values["num_scheduler_steps"]) or 1       # off: single steps
    values["speculative"] = config.speculative if values["speculative"] else None
    values["num_speculative_tokens"] = int(values["num_speculative_tokens"])
    values["speculative_max_batch"] = int(values["speculative_max_batch"])
    return Plan(**values, quantization=quantization, weight_block_size=weight_block_size)
