"""Chapter 09: the tensor-parallel model runner, built once by `TensorParallelEngine` (`build_tensor_parallel_runner`).

Rank 0's runner is the engine's: `execute` builds the step's host lists as every runner does, sends them to the
other ranks (`minirt.parallel.workers.send_step`), runs its shard of the forward pass (whose all-reduces meet
the other ranks' inside the model) and samples from the logits gathered to it. The other ranks run the same
class's `serve` loop: receive a step, run the same forward, join the LM head's gather, repeat.
Any error in a step ends the whole group (the ranks' collectives are out of step after it): every request then
resolves with an error, as the engine does for any failed step, and the engine must be built anew.
"""

from __future__ import annotations

import atexit
import os
import weakref

import torch
import torch.distributed as dist

from minirt.fast.runner import FastModelRunner, fast_parts
from minirt.model.decoder import DecoderModel
from minirt.model_runner import ModelRunner
from minirt.parallel.sharding import Communicator, check_shardable, shard_model
from minirt.parallel.workers import STEP_TIMEOUT_S, RankGroup, RankSpec, free_port, receive_step, send_step
from minirt.request import Request


class TensorParallelRunner(FastModelRunner):
    """A rank's model runner: `FastModelRunner` (the plan's attention kernels; never CUDA graphs) over the rank's
    shard of the model (`minirt.parallel.sharding.shard_model`) and its share of the KV heads,
    `kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads / world_size, head_dim]`. The block ids and the
    slot mapping are the same on every rank: one scheduler (rank 0's) decides for all.

    rank 0: `execute(items)`, as the engine calls any runner; `group` is its `RankGroup` (None on the others).
    `comm` (the model's `Communicator`) holds the seconds spent in the model's collectives, for measurements."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int, kernel, store, rank: int,
                 control, group: RankGroup | None = None):
        super().__init__(model, kv_cache, block_size, kernel, store)
        self.rank, self.control, self.group = rank, control, group
        self.comm: Communicator = model.comm

    def prepare_lists(self, items):
        step = ModelRunner.prepare_lists(self, items)   # the reference's lists, which `send_step` packs
        if self.rank == 0 and self.group.processes:     # the other ranks build nothing: they get rank 0's lists
            send_step(step, self.control, self.group.spec.step_timeout_s)
        return step

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """`ModelRunner.execute` on every rank at once. Raises RuntimeError (naming the ranks' errors and exit codes)
        if a rank has exited, a collective timed out or failed, or anything else failed in the step; the group is
        closed then and later calls raise at once."""
        self.group.check()
        try:
            return super().execute(items)
        except Exception as e:               # noqa: BLE001 - the ranks are out of step now: end the group
            raise self.group.fail(e) from e

    @torch.inference_mode()
    def serve(self) -> None:
        """Ranks 1..N-1: run rank 0's steps until it sends the stop command."""
        while (step := receive_step(self.control)) is not None:
            hidden = self.forward(step)
            if step.sample_rows:
                self.model.lm_head(hidden)       # this rank's slice of the logits, gathered to rank 0

    def close(self) -> None:
        """Stop and join every rank and release the process groups (rank 0; idempotent). Also done at interpreter
        exit and when the runner is garbage-collected."""
        if self.group is not None:
            self.group.close()


def build_rank_runner(spec: RankSpec, rank: int, control, group: RankGroup | None = None,
                      model: DecoderModel | None = None) -> TensorParallelRunner:
    """Rank `rank`'s runner: load the checkpoint (unless `model`, rank 0's, is given), keep the rank's shard, swap in
    the plan's fast modules, allocate the rank's KV cache."""
    if model is None:
        from minirt.model.loader import load_model

        model, _ = load_model(spec.checkpoint, device=spec.device_of(rank), dtype=spec.dtype)
    comm = Communicator(rank, spec.world_size, timed=spec.device == "cpu")
    shard_model(model, rank, spec.world_size, comm)
    kv_cache, kernel, store = fast_parts(spec.plan, model, spec.num_kv_blocks, spec.block_size, spec.max_num_seqs)
    return TensorParallelRunner(model, kv_cache, spec.block_size, kernel, store, rank, control, group)


def check_devices(device: torch.device, world_size: int) -> int:
    """The first CUDA index of the ranks (rank r on cuda:first + r), or 0 on the CPU. Raises ValueError naming
    tensor_parallel_size when there are too few GPUs."""
    if device.type != "cuda":
        return 0
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + world_size > count:
        raise ValueError(f"tensor_parallel_size: {world_size} ranks from cuda:{first} need cuda:{first}.."
                         f"cuda:{first + world_size - 1}, but {count} CUDA device(s) are visible")
    return first


def build_tensor_parallel_runner(world_size: int, plan, model: DecoderModel, num_kv_blocks: int, block_size: int,
                                 max_num_seqs: int, max_model_len: int) -> TensorParallelRunner:
    """The engine's runner for `tensor_parallel_size = world_size` (`TensorParallelEngine.build_model_runner`;
    `minirt.fast.build_model_runner`'s sibling, with the same arguments after `world_size`): start ranks 1..N-1
    (`RankGroup.start`), each loading the checkpoint `model` came from, and keep rank 0's shard of `model` (sharded
    in place). On the CPU the ranks talk over gloo, on CUDA over NCCL (rank r on cuda:first + r, first being
    `model`'s device).

    Raises ValueError naming tensor_parallel_size when heads, KV heads or MLP channels do not divide or GPUs are
    missing; RuntimeError if a rank fails to start (its own error quoted)."""
    check_shardable(model.config, world_size)
    first = check_devices(model.device, world_size)
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size: this process already holds a torch.distributed group (another "
                           "tensor-parallel engine?); close that engine first (engine.model_runner.close())")
    spec = RankSpec(checkpoint=model.checkpoint_path, dtype=str(model.dtype).removeprefix("torch."),
                    device=model.device.type, first_device=first, world_size=world_size, plan=plan,
                    num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len, host="127.0.0.1", port=free_port(),
                    num_threads=torch.get_num_threads(),
                    step_timeout_s=float(os.environ.get("MINIRT_TP_TIMEOUT_S", STEP_TIMEOUT_S)))
    group = RankGroup(spec)
    try:
        control = group.start()
        runner = build_rank_runner(spec, 0, control, group, model=model)
        group.wait_for("ready")
    except BaseException as e:
        errors = group.errors(wait_s=1.0) + group.exited()
        group.close(graceful=False)
        if isinstance(e, ValueError):
            raise
        raise RuntimeError(f"tensor_parallel_size: the ranks did not start: {type(e).__name__}: {e}"
                           + (f" ({'; '.join(errors)})" if errors else "")) from e
    weakref.finalize(runner, group.close)
    atexit.register(group.close)
    return runner
