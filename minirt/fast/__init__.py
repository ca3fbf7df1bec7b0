"""Chapter 07: the fast path, apart from the reference engine of chapters 00-06.

One plan, resolved once, says what runs (`plan.resolve_plan`, from the settings, the device and the model
config; `plan.RULES` is the only place that refuses a combination). The engine then builds from it, at
construction: `runner.build_model_runner` swaps the plan's fast modules into the loaded model
(`layers.speed_up_model`) and picks the attention kernels (`attention.attention_kernels`), the CUDA graphs
(`cuda_graphs.DecodeGraphs`) and the runner (`runner.FastModelRunner`); `multi_step.build_step` picks the step.
The reference modules never ask which of these runs.
"""

from minirt.fast.multi_step import build_step
from minirt.fast.plan import RULES, Hardware, Plan, resolve_plan
from minirt.fast.runner import build_model_runner

__all__ = ["Hardware", "Plan", "RULES", "build_model_runner", "build_step", "resolve_plan"]
