"""Chapter 09: Megatron-style tensor parallelism, swapped into a loaded reference model once (`shard_model`).

Shoeybi et al. 2019, "Megatron-LM", section 3: in each transformer block the first matrix of a pair is split by
its *output* columns (column-parallel: q/k/v, gate/up; every rank computes whole heads or whole MLP channels of
its own, with no communication), the second by its *input* rows (row-parallel: o_proj, down_proj; every rank
holds a partial sum of the full output, and one all-reduce adds them). Two all-reduces per layer, of
`[num_tokens, hidden_size]` each. The embedding and the LM head are split by vocabulary rows: a rank looks up
only the ids it owns (the others read zeros; one all-reduce), and computes only its slice of the logits (one
gather to rank 0, which samples). The KV heads, and with them each rank's KV cache, are split too.

nano-vllm's `layers/linear.py` and `layers/embed_head.py` build these layers at model construction and load
each shard through a weight loader; here the reference model (`minirt.model.decoder`) is loaded as it is and
its modules are replaced, as `minirt.fast.layers.speed_up_model` does, so the model code never asks whether
it runs sharded. Collectives are `torch.distributed`'s (gloo on the CPU, NCCL on GPUs), through a
`Communicator`, which also times them.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn
import torch.nn.functional as F
import torch.distributed as dist

from minirt.config import cdiv
from minirt.model.decoder import DecoderModel
from minirt.model.layers import head_dim_of


class Communicator:
    """The collectives a sharded model runs, over one `torch.distributed` process group (None: the default one),
    with the seconds and bytes they took accumulated in `seconds` and `bytes` (reset them between measurements).

    `world_size == 1` runs no collective at all. `timed`: on CUDA, collectives are queued on the stream and return
    at once, so they are timed only when `timed` is set, with a device synchronization before and after (which
    slows the step a little); on the CPU (gloo) they block and are always timed. A rank that waits here also waits
    for the slowest rank to arrive: the time includes the ranks' skew, not only the transfer.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, timed: bool = False):
        self.rank, self.world_size, self.group, self.timed = rank, world_size, group, timed
        self.seconds = 0.0
        self.bytes = 0
        self.calls = 0

    def _start(self, x: torch.Tensor) -> float:
        if self.timed and x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    def _stop(self, x: torch.Tensor, start: float) -> None:
        if self.timed and x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - start
        self.bytes += x.numel() * x.element_size()
        self.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it (every rank gets the sum)."""
        if self.world_size > 1:
            start = self._start(x)
            dist.all_reduce(x, group=self.group)
            self._stop(x, start)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' `x` `[..., n]` side by side, `[..., world_size * n]`, on rank 0; None on the others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        start = self._start(x)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        self._stop(x, start)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def check_shardable(config, world_size: int) -> None:
    """Refuse a model whose heads or MLP channels do not split evenly over `world_size` ranks: ValueError naming
    the field and both numbers. (vLLM replicates KV heads when there are fewer than ranks; minirt does not.)"""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(f"tensor_parallel_size: {name} = {value} is not divisible by tensor_parallel_size = "
                             f"{world_size} (each rank needs a whole share)")


def shard_config(config, world_size: int):
    """A copy of an HF config with each rank's share: heads, KV heads and MLP channels divided by `world_size`
    (`head_dim` written out, since it may have been derived from the full head count). Vocabulary and hidden size
    stay whole: the KV cache of a rank is allocated from this config (`minirt.kv.paged_cache.allocate_kv_cache`)."""
    check_shardable(config, world_size)
    local = copy.deepcopy(config)
    local.head_dim = head_dim_of(config)
    local.num_attention_heads = config.num_attention_heads // world_size
    local.num_key_value_heads = config.num_key_value_heads // world_size
    local.intermediate_size = config.intermediate_size // world_size
    return local


def split_range(size: int, rank: int, world_size: int) -> slice:
    """The `rank`-th of `world_size` equal contiguous parts of `range(size)` (size must divide)."""
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def column_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """The rank's output columns of `linear`: `[..., in] -> [..., out / world_size]`, a plain `nn.Linear` holding rows
    `split_range(out)` of the weight (and bias). Consecutive heads stay together, so splitting q/k/v this way gives
    each rank whole heads, and each query head keeps its KV head (GQA groups are consecutive too)."""
    rows = split_range(linear.out_features, rank, world_size)
    shard = nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None,
                      device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            shard.bias.copy_(linear.bias[rows])
    return shard.requires_grad_(False)


class RowParallelLinear(nn.Module):
    """The rank's input rows of `linear` (columns of its weight, `split_range(in)`): `[..., in / world_size] ->
    [..., out]`, a partial product that `comm.all_reduce` sums over the ranks; the bias is added once, after.
    Fed by a column-parallel layer's output shard, the sum equals `linear` on the whole input."""

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, comm: Communicator):
        super().__init__()
        cols = split_range(linear.in_features, rank, world_size)
        self.in_features, self.out_features = cols.stop - cols.start, linear.out_features
        self.weight = nn.Parameter(linear.weight[:, cols].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> nn.Parameter:
    """Rows `[rank * rows, (rank + 1) * rows)` of a `[vocab, hidden]` weight, `rows = ceil(vocab / world_size)`, the
    last rank's padded with zero rows (vLLM pads the vocabulary the same way)."""
    rows = cdiv(weight.shape[0], world_size)
    shard = weight[rank * rows:(rank + 1) * rows]
    padded = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    padded[:shard.shape[0]] = shard
    return nn.Parameter(padded, requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the vocabulary, `[vocab_start, vocab_start + rows)` with `rows = ceil(vocab / world_size)`
    (the last rank's shard padded with zero rows). `[...]` ids -> `[..., hidden]`: each rank looks up the ids it
    owns, writes zeros for the others, and one all-reduce assembles the whole lookup (nano-vllm's
    `VocabParallelEmbedding`)."""

    def __init__(self, embedding: nn.Embedding, rank: int, world_size: int, comm: Communicator):
        super().__init__()
        self.num_embeddings, self.rows = embedding.num_embeddings, cdiv(embedding.num_embeddings, world_size)
        self.vocab_start = rank * self.rows
        self.weight = vocab_shard(embedding.weight, rank, world_size)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine[..., None].to(self.weight.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The rank's vocabulary rows of the LM head (the same rows as `VocabParallelEmbedding`; the same tensor when the
    embeddings are tied). `[..., hidden] -> [..., vocab]` logits on rank 0, gathered from every rank's slice
    (padding dropped); None on the other ranks, which never sample."""

    def __init__(self, lm_head: nn.Linear, rank: int, world_size: int, comm: Communicator,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        if tied is not None:
            self.weight, self.vocab_size = tied.weight, tied.num_embeddings
        else:
            self.weight, self.vocab_size = vocab_shard(lm_head.weight, rank, world_size), lm_head.out_features
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.comm.gather_last_dim(F.linear(hidden, self.weight))
        return None if logits is None else logits[..., :self.vocab_size]


def shard_model(model: DecoderModel, rank: int, world_size: int, comm: Communicator) -> DecoderModel:
    """Keep only rank `rank`'s share of a loaded reference `model`, in place, once; returns it.

    Per layer: q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel (one all-reduce each); the
    attention's head counts become the rank's; norms and rotary tables stay whole (replicated). The embedding is
    vocab-parallel (one all-reduce), the LM head too (one gather to rank 0). `model.config` becomes the rank's
    config (`shard_config`), which the KV cache is allocated from; `model.full_config` keeps the checkpoint's.
    Raises ValueError when heads, KV heads or MLP channels do not divide by `world_size` (`check_shardable`).
    """
    local = shard_config(model.config, world_size)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (column_parallel(p, rank, world_size)
                                                 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, comm)
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        mlp.gate_proj, mlp.up_proj = column_parallel(mlp.gate_proj, rank, world_size), column_parallel(
            mlp.up_proj, rank, world_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, comm)
    body = model.model
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens, rank, world_size, comm)
    model.lm_head = ParallelLMHead(model.lm_head, rank, world_size, comm, body.embed_tokens if tied else None)
    model.full_config, model.config = model.config, local
    model.comm = comm
    return model
