"""Chapter 09: tensor parallelism over `torch.distributed`, around the engine and apart from it.

`sharding` splits a loaded reference model Megatron-style (column- and row-parallel linears, a vocab-parallel
embedding and LM head, the KV heads); `workers` starts one process per rank and carries each step's batch from
rank 0 to the others; `runner` holds the rank's model runner, which the engine picks once at construction when
`tensor_parallel_size > 1` (`build_tensor_parallel_runner`). The reference modules never ask whether they run
sharded.
"""

from minirt.parallel.runner import TensorParallelRunner, build_tensor_parallel_runner
from minirt.parallel.sharding import (Communicator, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                      check_shardable, column_parallel, shard_model)

__all__ = ["Communicator", "ParallelLMHead", "RowParallelLinear", "TensorParallelRunner", "VocabParallelEmbedding",
           "build_tensor_parallel_runner", "check_shardable", "column_parallel", "shard_model"]
