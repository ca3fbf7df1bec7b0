"""Chapter 07: the fast path, built on the reference engine of chapters 00-06.

One plan, resolved once, says what runs (`plan.resolve_plan`, from the settings, the device and the model
config; `plan.RULES` is the only place that refuses a combination). `engine.FastEngine`, chapter 05's `Engine`
built on, resolves it before the model loads and builds from it: `runner.build_model_runner` swaps the plan's fast
modules into the loaded model (`layers.speed_up_model`) and picks the attention kernels
(`attention.attention_kernels`), the CUDA graphs (`cuda_graphs.DecodeGraphs`) and the runner
(`runner.FastModelRunner`); with multi-step decode the scheduler is `multi_step.BurstScheduler`; `choose_step` picks
the step (`multi_step.BurstSteps`, `async_scheduling.AsyncSteps`). The reference modules never import this package.
"""

from minirt.fast.engine import FastEngine
from minirt.fast.plan import RULES, Hardware, Plan, resolve_plan
from minirt.fast.runner import build_model_runner

__all__ = ["FastEngine", "Hardware", "Plan", "RULES", "build_model_runner", "resolve_plan"]
