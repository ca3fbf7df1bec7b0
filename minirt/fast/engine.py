"""Chapter 07's engine: chapter 05's `Engine`, built from a plan.

`FastEngine` resolves every speed switch once into a `Plan` (`minirt.fast.plan.resolve_plan`), before the model
loads, so that a switch that cannot run is refused by name first. Then it builds what the plan says: its model
(`load_model`: with chapter 10's quantized weights), its runner (`build_model_runner`: the plan's fast modules
swapped into the model, its attention kernels and CUDA graphs, `minirt.fast.runner`), its scheduler
(`minirt.fast.multi_step.BurstScheduler` with multi-step decode) and its step (`choose_step`: bursts of decode
steps, overlap and async scheduling; with the plan's `speculative`, chapter 11's scheduler and step,
`minirt.spec.engine`, which runs the steps that draft nothing as those). `Engine.step`, the step chapter 05
shows, is never replaced; the step the loop runs is stored apart, in `step_fn` (as vLLM v1 keeps `step` and its
`step_fn`).
"""

from __future__ import annotations

import os

from minirt.config import EngineConfig, takes_settings
from minirt.engine import DEFAULT_MODEL, Engine
from minirt.fast.async_scheduling import AsyncSteps
from minirt.fast.multi_step import BurstScheduler, BurstSteps
from minirt.fast.plan import resolve_plan
from minirt.fast.runner import build_model_runner
from minirt.model.loader import load_config, resolve_checkpoint, resolve_device


class FastEngine(Engine):
    """`minirt.engine.Engine` with chapter 07's speedups: what runs is `plan` (a `minirt.fast.Plan`). The same
    arguments, and the same ValueError naming the field for a bad setting; for a switch asked for (True) that
    cannot run here, raised before the model loads. Where the plan is the reference (`plan.is_reference`, the
    defaults on a CPU), it runs exactly chapter 05's engine."""

    @takes_settings
    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, **settings):
        config = EngineConfig.from_settings(settings)
        #: What runs of chapter 07's switches, resolved once before anything is loaded (`minirt.fast.plan`).
        self.plan = resolve_plan(config, resolve_device(config.device), load_config(resolve_checkpoint(model)))
        super().__init__(model, **settings)

    def build_scheduler(self):
        """Chapter 06's scheduler; with multi-step decode, `BurstScheduler`, which also grants (and allocates the
        blocks of) bursts of decode steps; with speculative decoding, chapter 11's `SpeculativeScheduler`, which
        schedules draft tokens as rows (and grants bursts to the steps that draft nothing)."""
        if self.plan.speculative is not None:
            from minirt.spec.engine import SpeculativeScheduler

            return SpeculativeScheduler(self.config, self.pool, self.prefix_cache, self.plan.num_scheduler_steps)
        if self.plan.num_scheduler_steps == 1:
            return super().build_scheduler()
        return BurstScheduler(self.config, self.pool, self.prefix_cache, self.plan.num_scheduler_steps)

    #: The speculative step (`minirt.spec.engine.SpeculativeSteps`) where the plan's `speculative` is set.
    speculation = None

    def stats(self) -> dict:
        """`Engine.stats`, with speculative decoding also its counts (`SpeculativeSteps.stats`: drafts verified,
        their tokens, the tokens accepted)."""
        stats = super().stats()
        if self.speculation is not None:
            stats.update(self.speculation.stats())
        return stats

    def build_model_runner(self):
        """The plan's runner (`minirt.fast.runner.build_model_runner`); chapter 05's for the reference plan."""
        cfg = self.config
        return build_model_runner(self.plan, self.model, cfg.num_kv_blocks, cfg.block_size, cfg.max_num_seqs,
                                  cfg.max_model_len, cfg.max_num_batched_tokens)

    def choose_step(self):
        """`Engine.step` where the plan runs single steps; with `async_scheduling`, `AsyncSteps.step`; with
        multi-step decode, `BurstSteps.step` (or `BurstSteps.overlapped_step`, with overlap scheduling), whose
        single steps are one of those two. With speculative decoding, `SpeculativeSteps.step` (`minirt.spec.engine`,
        kept in `speculation`), which runs each step that drafts nothing as that same function (overlap and async
        scheduling included), and before a drafting step takes what it left in flight (`BurstSteps.drain`,
        `AsyncSteps.drain`)."""
        async_steps = AsyncSteps(self) if self.plan.async_scheduling else None
        bursts = BurstSteps(self, async_steps) if self.plan.num_scheduler_steps > 1 else None
        if bursts is not None:
            step = bursts.overlapped_step if self.plan.overlap_scheduling else bursts.step
        else:
            step = self.step if async_steps is None else async_steps.step
        if self.plan.speculative is None:
            return step
        from minirt.spec.engine import SpeculativeSteps
        from minirt.spec.proposer import build_proposer

        in_flight = bursts or async_steps                  # what `step` may leave in flight (None: nothing ever)
        self.speculation = SpeculativeSteps(self, build_proposer(self), self.plan.num_speculative_tokens,
                                            self.plan.speculative_max_batch, step,
                                            in_flight.drain if in_flight is not None else None)
        return self.speculation.step

    def load_model(self, path):
        """Chapter 00's model for float weights; with `plan.quantization` (chapter 10, `minirt.quant`), a
        pre-quantized FP8 checkpoint loaded by its `quantization_config` (`load_fp8_checkpoint`), or a float one
        loaded and its decoder linears quantized (`quantize_model`, with `plan.weight_block_size`)."""
        if self.plan.quantization is None:
            return super().load_model(path)
        from minirt.quant.model import checkpoint_quantization, load_fp8_checkpoint, quantize_model

        if checkpoint_quantization(load_config(path)) is not None:
            return load_fp8_checkpoint(path, device=self.config.device, dtype=self.config.dtype)
        model, tokenizer = super().load_model(path)
        quantize_model(model, self.plan.quantization, self.plan.weight_block_size)
        return model, tokenizer
