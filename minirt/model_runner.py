"""The model runner: turns a scheduled batch into tensors, runs one forward, samples.

All sequences of a step - prefill chunks and decodes - are packed into one `[1, num_tokens]` batch
with no padding (continuous batching; Yu et al. 2022, "Orca", section 4.1: iteration-level
scheduling with selective batching). Only the rows that need a next token go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minirt.attention import PagedAttention, PagedAttentionMetadata, paged_attention_reference, store_kv
from minirt.kv.paged_cache import slot_mapping
from minirt.model.decoder import DecoderModel
from minirt.request import Request
from minirt.sampling import sample


@dataclass
class StepInputs:
    """One step's packed batch as host lists (`minirt.model_runner.ModelRunner.prepare_lists`).

    input_ids, positions, slots: `[num_tokens]`; query_start_loc: `[num_seqs + 1]`; context_lens and
    block_tables: `[num_seqs]` (each table a list of block ids). sample_rows / sample_requests: for each
    request whose computed tokens reach the end of its known tokens this step (a finished prompt or a
    decode), the index of its last token in the batch, and the request.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    max_query_len: int = 0


class ModelRunner:
    """Owns the model and the KV tensor; knows nothing about scheduling.

    `attention_kernel`, `store`: the paged-attention kernel and K/V write (see `minirt.attention.PagedAttention`).
    `decode_graphs`: a `minirt.cuda_graphs.DecodeGraphs`, used for steps in which every sequence has one new
    token (chapter 07).
    """

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int,
                 attention_kernel=paged_attention_reference, decode_graphs=None, store=store_kv):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.attention_kernel = attention_kernel
        self.store = store
        self.decode_graphs = decode_graphs

    def prepare_lists(self, items: list[tuple[Request, int]]) -> StepInputs:
        """The packed batch of `(request, num_new_tokens)` items as host lists (see `StepInputs`)."""
        B = self.block_size
        step = StepInputs(max_query_len=max(n for _, n in items))
        for request, n in items:
            start = request.num_computed_tokens
            step.input_ids += request.token_ids[start:start + n]
            step.positions += range(start, start + n)
            step.slots += slot_mapping(request.block_table, start, start + n, B)
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.context_lens.append(start + n)
            step.block_tables.append(request.block_table)
            if start + n == len(request.token_ids):
                step.sample_rows.append(step.query_start_loc[-1] - 1)
                step.sample_requests.append(request)
        return step

    def to_device(self, step: StepInputs, lookahead: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """`(input_ids [1, N], positions [1, N], metadata)` on the device; block tables padded with 0 to the
        widest context of the step, plus `lookahead` tokens (the later steps of `execute_decode_steps`)."""
        max_ctx = max(step.context_lens)
        width = -((max_ctx + lookahead) // -self.block_size)
        block_tables = [t[:width] + [0] * (width - len(t[:width])) for t in step.block_tables]
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = PagedAttentionMetadata(
            slot_mapping=as_long(step.slots), query_start_loc=as_long(step.query_start_loc),
            context_lens=as_long(step.context_lens), block_tables=as_long(block_tables),
            max_query_len=step.max_query_len, max_context_len=max_ctx)
        return as_long(step.input_ids)[None], as_long(step.positions)[None], meta

    def _forward_decode_graph(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states `[num_sampled, hidden]` of the sampled rows, through a CUDA graph, for a step whose
        sequences all have one new token (decodes, and 1-token prefill chunks, which are sampled only if they
        finish their prompt); None if there is no graph for it."""
        graphs = self.decode_graphs
        if graphs is None or step.max_query_len != 1 or len(step.input_ids) > graphs.sizes[-1]:
            return None
        hidden = graphs.run(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
        rows = step.sample_rows
        return hidden if len(rows) == len(step.input_ids) else hidden[rows]

    def sampling_tensors(self, requests: list[Request]) -> tuple[torch.Tensor, ...] | None:
        """`(temperature, top_k, top_p)` `[num_requests]` on the device for `minirt.sampling.sample`, or None
        when every request is greedy (decided on the host: no device sync to find out)."""
        params = [r.params for r in requests]
        if all(p.greedy for p in params):
            return None
        dev = self.device
        return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev))

    def sample(self, hidden: torch.Tensor, requests: list[Request], tensors: tuple | None = None) -> torch.Tensor:
        """The next token of each row of `hidden` `[num_rows, hidden_size]` (row i belongs to `requests[i]`):
        `[num_rows]` int64 on the device. An all-greedy batch takes the argmax with no host sync; others go
        through `minirt.sampling.sample`. `tensors`: `sampling_tensors(requests)`, built by the caller when it
        samples the same requests several times (multi-step decode); None builds them here."""
        logits = self.model.compute_logits(hidden)                             # [num_rows, vocab]
        tensors = tensors or self.sampling_tensors(requests)
        if tensors is None:
            return logits.argmax(dim=-1)
        return sample(logits, *tensors, [r.generator for r in requests])

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run one step. Returns the requests that got a new token, and those tokens (one host sync)."""
        step = self.prepare_lists(items)
        requests = step.sample_requests
        hidden = self._forward_decode_graph(step)
        if hidden is None:
            input_ids, positions, meta = self.to_device(step)
            hidden = self.model(input_ids, positions, attn=PagedAttention(self.kv_cache, meta, self.attention_kernel, self.store))
            hidden = hidden[0, step.sample_rows]
        if not requests:
            return [], []
        return requests, self.sample(hidden, requests).tolist()

    @torch.inference_mode()
    def execute_decode_steps(self, items: list[tuple[Request, int]], num_steps: int
                             ) -> tuple[list[Request], list[list[int]]]:
        """Run `num_steps` decode steps of the same requests back to back, with one host sync at the end
        (when every request is greedy; `minirt.sampling.sample` syncs inside for the others, as in single steps).

        Multi-step scheduling (vLLM 0.6, "--num-scheduler-steps"): the host's work between two steps
        (postprocess, schedule, build the inputs, launch) leaves the GPU idle once per step; here each step's
        sampled tokens become the next step's inputs on the device (`advance_decode_inputs`), so the host only
        launches, and the GPU runs the steps one after another. `items` are decodes (one new token each) whose
        block tables already hold `num_steps` new tokens (`Scheduler.decode_steps_ahead`). Returns the requests
        and their tokens, `[num_steps][num_requests]`; a request that stops part-way (EOS, a stop string) gets
        tokens past its end, which the engine drops.
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
            input_ids, positions, meta = self.to_device(step, lookahead=num_steps - 1)
            attn = PagedAttention(self.kv_cache, meta, self.attention_kernel, self.store)
            hidden = self.model(input_ids, positions, attn=attn)[0]
            inputs = (input_ids[0], positions[0], meta.slot_mapping, meta.context_lens, meta.block_tables)
        tensors = self.sampling_tensors(requests)                          # once per burst
        tokens = [self.sample(hidden, requests, tensors)]
        for _ in range(num_steps - 1):
            advance_decode_inputs(tokens[-1], *inputs, self.block_size)
            if meta is None:
                hidden = graphs.replay(num_seqs)
            else:
                meta.max_context_len += 1
                hidden = self.model(input_ids, positions, attn=attn)[0]
            tokens.append(self.sample(hidden, requests, tensors))
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
