"""Chapter 09: tensor parallelism over `torch.distributed`, around the engine and apart from it.

`sharding` splits a loaded reference model Megatron-style (column- and row-parallel linears, a vocab-parallel
embedding and LM head, the KV heads); `workers` starts one process per rank (`rank` is its entry point) and
carries each step's batch from rank 0 to the others; `runner` holds the rank's model runner
(`build_tensor_parallel_runner`); `engine` holds `TensorParallelEngine`, chapter 07's engine with that runner,
which `minirt.Engine` and `minirt.LLM` build when `tensor_parallel_size > 1`. This package builds on
`minirt.fast`, never the other way; the reference modules never ask whether they run sharded.
"""

from minirt.parallel.engine import TensorParallelEngine
from minirt.parallel.runner import TensorParallelRunner, build_tensor_parallel_runner
from minirt.parallel.sharding import (Communicator, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                      check_shardable, column_parallel, shard_model)

__all__ = ["Communicator", "ParallelLMHead", "RowParallelLinear", "TensorParallelEngine", "TensorParallelRunner",
           "VocabParallelEmbedding", "build_tensor_parallel_runner", "check_shardable", "column_parallel",
           "shard_model"]
