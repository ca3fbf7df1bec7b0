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
    """Owns the model and the KV tensor; knows nothing about scheduling.

    `decode_graphs`: a `minirt.cuda_graphs.DecodeGraphs`, used for steps made only of decodes (chapter 07).
    """

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int,
                 attention_kernel=paged_attention_reference, decode_graphs=None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.attention_kernel = attention_kernel
        self.decode_graphs = decode_graphs

    def prepare_lists(self, items: list[tuple[Request, int]]) -> dict:
        """The packed batch as host lists: input_ids, positions, slots (`[num_tokens]` each), query_start_loc
        (`[num_seqs + 1]`), context_lens, block_tables (`[num_seqs]`), and `sample_rows`/`sample_requests`:
        for each request whose computed tokens reach the end of its known tokens this step (a finished prompt
        or a decode), the index of its last token in the batch."""
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
        return dict(input_ids=input_ids, positions=positions, slots=slots, query_start_loc=query_start_loc,
                    context_lens=context_lens, block_tables=tables, sample_rows=sample_rows,
                    sample_requests=sample_requests, max_query_len=max(n for _, n in items))

    def prepare(self, items: list[tuple[Request, int]], lists: dict | None = None):
        """Build `(input_ids [1, N], positions [1, N], metadata, sample_rows, sample_requests)` on the device
        (from `lists`, the output of `prepare_lists(items)`, when given)."""
        b = lists or self.prepare_lists(items)
        B = self.block_size
        max_ctx = max(b["context_lens"])
        width = -(max_ctx // -B)
        block_tables = [t[:width] + [0] * (width - len(t[:width])) for t in b["block_tables"]]
        dev = self.device
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        meta = PagedAttentionMetadata(
            slot_mapping=as_long(b["slots"]), query_start_loc=as_long(b["query_start_loc"]),
            context_lens=as_long(b["context_lens"]), block_tables=as_long(block_tables),
            max_query_len=b["max_query_len"], max_context_len=max_ctx)
        return (as_long(b["input_ids"])[None], as_long(b["positions"])[None], meta, b["sample_rows"],
                b["sample_requests"])

    def _forward_decode_graph(self, b: dict) -> torch.Tensor | None:
        """Hidden states `[num_sampled, hidden]` of the sampled rows, through a CUDA graph, for a step whose
        sequences all have one new token (decodes, and 1-token prefill chunks, which are sampled only if they
        finish their prompt); None if there is no graph for it."""
        graphs = self.decode_graphs
        if graphs is None or b["max_query_len"] != 1 or len(b["input_ids"]) > graphs.sizes[-1]:
            return None
        hidden = graphs.run(b["input_ids"], b["positions"], b["slots"], b["context_lens"], b["block_tables"])
        rows = b["sample_rows"]
        return hidden if len(rows) == len(b["input_ids"]) else hidden[rows]

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run one step. Returns the requests that got a new token, and those tokens (one host sync)."""
        b = self.prepare_lists(items)
        requests = b["sample_requests"]
        hidden = self._forward_decode_graph(b)
        if hidden is None:
            input_ids, positions, meta, rows, requests = self.prepare(items, b)
            hidden = self.model(input_ids, positions, attn=PagedAttention(self.kv_cache, meta, self.attention_kernel))
            hidden = hidden[0, rows]
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
