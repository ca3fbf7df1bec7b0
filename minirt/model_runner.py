"""The model runner: turns a scheduled batch into tensors, runs one forward, samples.

All sequences of a step - prefill chunks and decodes - are packed into one `[1, num_tokens]` batch
with no padding (continuous batching; Yu et al. 2022, "Orca", section 4.1: iteration-level
scheduling with selective batching). Only the rows that need a next token go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minirt.attention import PagedAttention, PagedAttentionMetadata
from minirt.config import cdiv
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


def pad_block_tables(block_tables: list[list[int]], width: int) -> list[list[int]]:
    """Each table cut or padded with block 0 to `width` entries (entries past a context are never read)."""
    return [t[:width] + [0] * (width - len(t[:width])) for t in block_tables]


class ModelRunner:
    """Owns the model and the KV tensor `[num_layers, 2, num_blocks, block_size, Hkv, D]`; knows nothing about
    scheduling."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device

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
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = PagedAttentionMetadata(
            slot_mapping=as_long(step.slots), query_start_loc=as_long(step.query_start_loc),
            context_lens=as_long(step.context_lens),
            block_tables=as_long(pad_block_tables(step.block_tables, cdiv(max_ctx, self.block_size))),
            max_query_len=step.max_query_len, max_context_len=max_ctx)
        return as_long(step.input_ids)[None], as_long(step.positions)[None], meta

    def attention(self, meta: PagedAttentionMetadata) -> PagedAttention:
        """The attention backend of one step: paged attention over this runner's cache."""
        return PagedAttention(self.kv_cache, meta)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """One forward of the packed batch: the hidden states `[num_sampled, hidden_size]` of its sampled rows."""
        input_ids, positions, meta = self.to_device(step)
        hidden = self.model(input_ids, positions, attn=self.attention(meta))
        return hidden[0, step.sample_rows]

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

    def sample(self, hidden: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The next token of each row of `hidden` `[num_rows, hidden_size]` (row i belongs to `requests[i]`):
        `[num_rows]` int64 on the device. An all-greedy batch takes the argmax with no host sync; others go
        through `minirt.sampling.sample`."""
        logits = self.model.compute_logits(hidden)                             # [num_rows, vocab]
        tensors = self.sampling_tensors(requests)
        if tensors is None:
            return logits.argmax(dim=-1)
        return sample(logits, *tensors, [r.generator for r in requests])

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run one step. Returns the requests that got a new token, and those tokens (one host sync)."""
        step = self.prepare_lists(items)
        hidden = self.forward(step)
        if not step.sample_requests:
            return [], []
        return step.sample_requests, self.sample(hidden, step.sample_requests).tolist()
