"""Engine settings, validated once: a bad value fails at construction with the field's name and limit."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    """Knobs of the engine (names as in vLLM).

    block_size: token slots per KV block. num_kv_blocks: blocks in the pool (None = sized from memory).
    max_num_seqs: requests admitted at once (prefilling + running).
    max_num_batched_tokens: the per-step token budget, decodes and prefill chunks together.
    max_prefill_chunk: the most prompt tokens one request may prefill in one step.
    max_model_len: prompt + max_new_tokens limit (None = the model's max_position_embeddings).
    enable_prefix_caching: share full KV blocks between requests with equal prefixes.
    attention_backend: "auto" (the Triton kernel on CUDA when it can run, else torch), "torch" (the
    reference in `minirt.attention`) or "triton" (see `minirt.kernels`).
    split_kv: let several programs of the Triton kernel share one decode's keys when the batch is small
    (flash-decoding; see `minirt.kernels.paged_attention_triton`).
    enforce_eager: never use CUDA graphs. Otherwise decode-only steps replay a CUDA graph where one can run
    (CUDA and the Triton kernel; see `minirt.cuda_graphs`).
    fused_ops: compile the norms (with their residual additions), the q/k norm with the rotation, and
    SiLU-and-multiply into fused kernels with `torch.compile` (see `minirt.model.layers.fused`); None = on
    CUDA devices only. The first engine in a process pays the compilation (tens of seconds; later ones reuse it).
    merge_projections: one GEMM for q/k/v and one for gate/up (see `minirt.model.layers.merge_linears`);
    None = on CUDA devices only.
    gemv: one-row matrix products (every GEMM of a batch-1 decode step, and its LM head) through the Triton
    matrix-vector kernel instead of cuBLAS (see `minirt.kernels.gemv_triton`); None = with CUDA graphs, which
    hide its launch cost (a Triton launch from Python costs more CPU time than a cuBLAS one).
    num_scheduler_steps: decode steps run back to back per schedule when every admitted request is decoding
    and none waits, each step's sampled tokens fed to the next on the device, with one host sync at the end when
    every request is greedy (a sampling request adds the sampler's syncs, as in single steps). Multi-step
    scheduling, vLLM 0.6's `--num-scheduler-steps`; see `minirt.model_runner.ModelRunner.execute_decode_steps`.
    None = 8 with CUDA graphs, where the host's per-step work is a large share of a step, else 1 (off).
    norm_in_gemv: in one-token steps, run each layer's two RMSNorms (with their residual additions) in the
    prologue of the GEMV kernel after them, the merged q/k/v and gate/up projections (see
    `minirt.model.decoder.DecoderLayer.forward_one_row`); needs gemv and merge_projections. None = where both are on.
    rotary_kernel: the q/k norm and the rotation of q and k in one Triton kernel instead of the two that
    `torch.compile` makes of them (see `minirt.kernels.rotary_triton`). None = with CUDA graphs.
    pdl: launch the Triton kernels (GEMV, paged attention, K/V write, rotary) with programmatic dependent launch, so each
    starts while the one before finishes and the GEMV streams its first weights meanwhile (see
    `minirt.kernels.gemv_triton.linear_gemv`); needs a Hopper or later GPU. None = with CUDA graphs where it can run.
    kv_write_in_rotary: the rotary kernel also writes each step's keys and values into the paged KV cache, so the
    attention backend's K/V write is not launched (see `minirt.kernels.rotary_triton.norm_rotate_and_store_triton`);
    needs rotary_kernel. None = with the rotary kernel.
    combine_in_attention: with split-KV, the last program to finish a decode's keys combines the splits' results
    inside the attention kernel instead of a second kernel (see `paged_attention_triton`'s `split_counters`);
    needs the Triton attention kernel and split_kv. Off by default: one launch fewer, but slower on an H200 with
    PDL, which already hides the second kernel's launch (chapter 07 shows the measurement).
    prefetch_kv: with PDL, in split-KV launches (small decode batches) the Triton attention kernel loads the keys
    and values of earlier steps (its first tile) before it waits for the kernel before it, and only q and this
    step's keys after (see `paged_attention_triton`'s `prefetch_kv`); False: it waits first. Needs pdl, split_kv
    and the Triton attention kernel. None = wherever all three are on.
    l2_prefetch: each one-row GEMV of a decode step asks the L2 cache for the weights of the GEMV after it (q/k/v,
    o_proj, gate/up, down, the next layer's q/k/v), which stream in while it runs (see
    `minirt.model.decoder.DecoderModel.prefetch_next_weights`); needs gemv, merge_projections and a Hopper or later
    GPU. None = with the GEMV kernel, merged projections and PDL.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
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
    combine_in_attention: bool = False
    prefetch_kv: bool | None = None
    l2_prefetch: bool | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_scheduler_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: must be an integer >= 1 or None, got {value!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("enable_prefix_caching", "split_kv", "enforce_eager", "combine_in_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        for name, auto in (("fused_ops", "on CUDA only"), ("merge_projections", "on CUDA only"),
                           ("gemv", "with CUDA graphs"), ("norm_in_gemv", "with gemv and merged projections"),
                           ("rotary_kernel", "with CUDA graphs"),
                           ("pdl", "with CUDA graphs where it can run"),
                           ("kv_write_in_rotary", "with the rotary kernel"),
                           ("prefetch_kv", "with PDL and the Triton attention kernel"),
                           ("l2_prefetch", "with the GEMV kernel, merged projections and PDL")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: must be a bool or None (None = {auto}), got {value!r}")
        if self.norm_in_gemv and (self.gemv is False or self.merge_projections is False):
            raise ValueError("norm_in_gemv: the norm runs in the GEMV kernel's prologue of a merged projection, "
                             f"so it needs gemv and merge_projections, got gemv={self.gemv!r}, "
                             f"merge_projections={self.merge_projections!r}")
        if self.l2_prefetch and (self.gemv is False or self.merge_projections is False):
            raise ValueError("l2_prefetch: the GEMV kernels of merged projections ask L2 for the next weights, so it "
                             f"needs gemv and merge_projections, got gemv={self.gemv!r}, "
                             f"merge_projections={self.merge_projections!r}")
        if self.kv_write_in_rotary and self.rotary_kernel is False:
            raise ValueError("kv_write_in_rotary: the K/V write runs in the rotary kernel, so it needs rotary_kernel, "
                             "got rotary_kernel=False")
        if self.combine_in_attention and (not self.split_kv or self.attention_backend == "torch"):
            raise ValueError("combine_in_attention: combines split-KV results in the Triton attention kernel, so it "
                             f"needs split_kv and that kernel, got split_kv={self.split_kv!r}, "
                             f"attention_backend={self.attention_backend!r}")
        if self.prefetch_kv and (self.pdl is False or not self.split_kv or self.attention_backend == "torch"):
            raise ValueError("prefetch_kv: loads K/V before the PDL wait in split-KV launches of the Triton attention "
                             f"kernel, so it needs pdl, split_kv and that kernel, got pdl={self.pdl!r}, "
                             f"split_kv={self.split_kv!r}, attention_backend={self.attention_backend!r}")


def cdiv(a: int, b: int) -> int:
    return -(a // -b)
