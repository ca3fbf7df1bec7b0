"""The model runner: turns a scheduled batch into tensors, runs one forward, samples.

All sequences of a step - prefill chunks and decodes - are packed into one `[1, num_tokens]` batch
with no padding (continuous batching; Yu et al. 2022, "Orca", section 4.1: iteration-level
scheduling with selective batching). Only the rows that need a next token go through the LM head.
"""

from __future__ import annotations

import torch

from minirt.attention import PagedAttention, PagedAttentionMetadata, paged_attention_reference
from minirt.kv.paged_cache import slot_mapping
from minirt.model.decoder import DecoderModel
from minirt.request import Request
from minirt.sampling import sample


class ModelRunner:
    """Owns the model and the KV tensor; knows nothing about scheduling."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int,
                 attention_kernel=paged_attention_reference):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.attention_kernel = attention_kernel

    def prepare(self, items: list[tuple[Request, int]]):
        """Build `(input_ids [1, N], positions [1, N], metadata, sample_rows)` for the packed batch.

        `sample_rows` lists, for each request whose computed tokens reach the end of its known tokens
        this step (a finished prompt or a decode), the index of its last token in the batch.
        """
        B = self.block_size
        input_ids, positions, slots, query_start_loc, context_lens, tables = [], [], [], [0], [], []
        sample_rows, sample_requests = [], []
        for request, n in items:
            start = request.num_computed_tokens
            input_ids += request.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += slot_mapping(request.block_table, start, start + n, B)
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start + n)
            tables.append(request.block_table)
            if start + n == len(request.token_ids):
                sample_rows.append(query_start_loc[-1] - 1)
                sample_requests.append(request)
        max_ctx = max(context_lens)
        width = -(max_ctx // -B)
        block_tables = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        dev = self.device
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        meta = PagedAttentionMetadata(
            slot_mapping=as_long(slots), query_start_loc=as_long(query_start_loc),
            context_lens=as_long(context_lens), block_tables=as_long(block_tables),
            max_query_len=max(n for _, n in items), max_context_len=max_ctx)
        return as_long(input_ids)[None], as_long(positions)[None], meta, sample_rows, sample_requests

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run one step. Returns the requests that got a new token, and those tokens (one host sync)."""
        input_ids, positions, meta, rows, requests = self.prepare(items)
        hidden = self.model(input_ids, positions, attn=PagedAttention(self.kv_cache, meta, self.attention_kernel))
        if not requests:
            return [], []
        logits = self.model.compute_logits(hidden[0, rows])                   # [num_sampled, vocab]
        params = [r.params for r in requests]
        dev = self.device
        next_ids = sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            [r.generator for r in requests])
        return requests, next_ids.tolist()
