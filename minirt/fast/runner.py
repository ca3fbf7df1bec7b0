"""The model runner of the fast path: the plan's attention kernel, CUDA graphs for decode steps, and multi-step
decode's bursts (`FastModelRunner`), built once from a plan by `build_model_runner`."""

from __future__ import annotations

import torch

from minirt.config import cdiv
from minirt.fast.attention import KernelPagedAttention, attention_kernels
from minirt.fast.cuda_graphs import DecodeGraphs
from minirt.fast.layers import speed_up_model
from minirt.kv.paged_cache import allocate_kv_cache
from minirt.model.decoder import DecoderModel
from minirt.model_runner import ModelRunner, StepInputs, pad_block_tables
from minirt.request import Request
from minirt.sampling import sample


class FastModelRunner(ModelRunner):
    """`ModelRunner` whose steps attend with `kernel` and `store` (see `KernelPagedAttention`) and, where
    `decode_graphs` is given (a `DecodeGraphs`), replay a CUDA graph for steps in which every sequence has one
    new token; `execute_decode_steps` runs several decode steps back to back."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int, kernel, store,
                 decode_graphs: DecodeGraphs | None = None):
        super().__init__(model, kv_cache, block_size)
        self.kernel, self.store, self.decode_graphs = kernel, store, decode_graphs

    def attention(self, meta) -> KernelPagedAttention:
        return KernelPagedAttention(self.kv_cache, meta, self.kernel, self.store)

    def forward(self, step: StepInputs) -> torch.Tensor:
        hidden = self.forward_decode_graph(step)
        return super().forward(step) if hidden is None else hidden

    def forward_decode_graph(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states `[num_sampled, hidden]` of the sampled rows, through a CUDA graph, for a step whose
        sequences all have one new token (decodes, and 1-token prefill chunks, which are sampled only if they
        finish their prompt); None if there is no graph for it."""
        graphs = self.decode_graphs
        if graphs is None or step.max_query_len != 1 or len(step.input_ids) > graphs.sizes[-1]:
            return None
        hidden = graphs.run(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
        rows = step.sample_rows
        return hidden if len(rows) == len(step.input_ids) else hidden[rows]

    @torch.inference_mode()
    def execute_decode_steps(self, items: list[tuple[Request, int]], num_steps: int
                             ) -> tuple[list[Request], list[list[int]]]:
        """Run `num_steps` decode steps of the same requests back to back, with one host sync at the end
        (when every request is greedy; `minirt.sampling.sample` syncs inside for the others, as in single steps).

        Multi-step scheduling (vLLM 0.6, "--num-scheduler-steps"): the host's work between two steps
        (postprocess, schedule, build the inputs, launch) leaves the GPU idle once per step; here each step's
        sampled tokens become the next step's inputs on the device (`advance_decode_inputs`), so the host only
        launches, and the GPU runs the steps one after another. `items` are decodes (one new token each) whose
        block tables already hold `num_steps` new tokens (`minirt.fast.multi_step.decode_steps_ahead`). Returns the
        requests and their tokens, `[num_steps][num_requests]`; a request that stops part-way (EOS, a stop string)
        gets tokens past its end, which the engine drops. Raises ValueError if an item is not a decode.
        """
        step = self.prepare_lists(items)
        requests = step.sample_requests
        if step.max_query_len != 1 or len(requests) != len(items):
            raise ValueError("execute_decode_steps: every item must be a decode (one new token, sampled)")
        graphs, num_seqs = self.decode_graphs, len(items)
        if graphs is not None and num_seqs <= graphs.sizes[-1]:
            hidden = graphs.run(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
            inputs, meta = graphs.inputs(num_seqs), None
        else:
            input_ids, positions, meta = self.to_device(step)
            width = cdiv(meta.max_context_len + num_steps - 1, self.block_size)     # the later steps' blocks too
            meta.block_tables = torch.tensor(pad_block_tables(step.block_tables, width), device=self.device)
            attn = self.attention(meta)
            hidden = self.model(input_ids, positions, attn=attn)[0]
            inputs = (input_ids[0], positions[0], meta.slot_mapping, meta.context_lens, meta.block_tables)
        tensors = self.sampling_tensors(requests)                          # once per burst
        generators = [r.generator for r in requests]

        def next_tokens(hidden):                                           # `ModelRunner.sample` with those
            logits = self.model.compute_logits(hidden)
            return logits.argmax(dim=-1) if tensors is None else sample(logits, *tensors, generators)

        tokens = [next_tokens(hidden)]
        for _ in range(num_steps - 1):
            advance_decode_inputs(tokens[-1], *inputs, self.block_size)
            if meta is None:
                hidden = graphs.replay(num_seqs)
            else:
                meta.max_context_len += 1
                hidden = self.model(input_ids, positions, attn=attn)[0]
            tokens.append(next_tokens(hidden))
        return requests, torch.stack(tokens).tolist()


def advance_decode_inputs(next_ids: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          block_size: int) -> None:
    """Turn one decode step's device inputs into the next step's, in place, with no host work.

    next_ids, input_ids, positions, slot_mapping, context_lens `[num_seqs]` int64; block_tables
    `[num_seqs, max_blocks]`, which must already hold the blocks of the next positions. The sampled tokens
    become the inputs, positions and context lengths move on by one, and each slot is looked up in the block
    table on the device: `block_tables[s, p // block_size] * block_size + p % block_size`.
    """
    input_ids.copy_(next_ids)
    positions.add_(1)
    context_lens.add_(1)
    blocks = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]
    slot_mapping.copy_(blocks * block_size + positions % block_size)


def fast_parts(plan, model: DecoderModel, num_kv_blocks: int, block_size: int, max_num_seqs: int):
    """`(kv_cache, kernel, store)` for a plan, once its fast modules are swapped into `model` (`speed_up_model`;
    none for the reference plan): the plan's attention kernels and a KV cache of `num_kv_blocks` blocks, plus the
    CUDA graphs' scratch block when the plan captures them. Shared with the tensor-parallel ranks."""
    if not plan.is_reference:
        speed_up_model(model, plan)
    kernel, store = attention_kernels(plan, model.device, max_num_seqs, model.config.num_key_value_heads)
    kv_cache = allocate_kv_cache(model.config, num_kv_blocks + plan.cuda_graphs, block_size, model.dtype,
                                 model.device)
    return kv_cache, kernel, store


def build_model_runner(plan, model: DecoderModel, num_kv_blocks: int, block_size: int, max_num_seqs: int,
                       max_model_len: int, tensor_parallel_size: int = 1) -> ModelRunner:
    """The engine's model runner for a plan (`minirt.fast.plan.Plan`), with its KV cache of `num_kv_blocks` blocks.

    With `tensor_parallel_size > 1`, chapter 09's runner over that many processes
    (`minirt.parallel.build_tensor_parallel_runner`; the plan's rules keep off what it cannot run).
    For the reference plan, chapter 05's `ModelRunner` over the model as loaded. Otherwise the plan's fast modules
    are swapped into the model (`speed_up_model`), and a `FastModelRunner` gets the plan's attention kernels and,
    with CUDA graphs, one more KV block than the pool hands out: the scratch block padding rows write to.
    """
    if tensor_parallel_size > 1:
        from minirt.parallel import build_tensor_parallel_runner

        return build_tensor_parallel_runner(tensor_parallel_size, plan, model, num_kv_blocks, block_size,
                                            max_num_seqs, max_model_len)
    if plan.is_reference:
        return ModelRunner(model, allocate_kv_cache(model.config, num_kv_blocks, block_size, model.dtype,
                                                    model.device), block_size)
    kv_cache, kernel, store = fast_parts(plan, model, num_kv_blocks, block_size, max_num_seqs)
    graphs = None
    if plan.cuda_graphs:
        graphs = DecodeGraphs(model, kv_cache, kernel, store, max_num_seqs, cdiv(max_model_len, block_size),
                              scratch_block=num_kv_blocks)
    return FastModelRunner(model, kv_cache, block_size, kernel, store, graphs)
