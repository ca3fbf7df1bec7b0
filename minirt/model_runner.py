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

    def to_device(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """`(input_ids [1, N], positions [1, N], metadata)` on the device; block tables padded with 0 to the
        widest context of the step."""
        max_ctx = max(step.context_lens)
        width = -(max_ctx // -self.block_size)
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
        logits = self.model.compute_logits(hidden)                             # [num_sampled, vocab]
        params = [r.params for r in requests]
        if all(p.greedy for p in params):                  # decided on the host: no device sync to find out
            return requests, logits.argmax(dim=-1).tolist()
        dev = self.device
        next_ids = sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            [r.generator for r in requests])
        return requests, next_ids.tolist()
