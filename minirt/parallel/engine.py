"""Chapter 09: the engine over `tensor_parallel_size` processes, which `minirt.Engine` and `minirt.LLM` build when
`tensor_parallel_size > 1`.

`TensorParallelEngine` is chapter 07's `FastEngine` (the same plan, whose rules keep off what the ranks cannot run:
CUDA graphs, GEMVs, bursts) with another runner: rank 0's `TensorParallelRunner`, which starts the other ranks
(`minirt.parallel.runner.build_tensor_parallel_runner`). The scheduler, the step and the loop are the engine's own.
"""

from __future__ import annotations

from minirt.fast.engine import FastEngine
from minirt.parallel.runner import TensorParallelRunner, build_tensor_parallel_runner


class TensorParallelEngine(FastEngine):
    """`FastEngine` over `config.tensor_parallel_size` processes, one rank each (rank 0 is this process). Raises
    ValueError naming tensor_parallel_size when the model's heads, KV heads or MLP channels do not divide or GPUs
    are missing; RuntimeError if a rank fails to start. `engine.model_runner.close()` stops the ranks."""

    def build_model_runner(self) -> TensorParallelRunner:
        cfg = self.config
        return build_tensor_parallel_runner(cfg.tensor_parallel_size, self.plan, self.model, cfg.num_kv_blocks,
                                            cfg.block_size, cfg.max_num_seqs, cfg.max_model_len)
