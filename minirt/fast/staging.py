"""A step's inputs in one asynchronous host-to-device copy: the fast runner's `to_device`.

The reference runner (`minirt.model_runner.ModelRunner.to_device`, chapter 05) makes each input tensor with
`torch.tensor(list, device=...)`: six copies from pageable memory for a step, and each one returns only once the
GPU has run everything queued before it, so the host waits while it could be launching. Here a step's inputs are
written into one pinned host buffer and copied with one asynchronous copy; the tensors the step runs on are views
of its device twin. The rows to sample go with them, so that selecting them launches a gather instead of waiting
for the forward to finish. vLLM's GPU model runner keeps its inputs in pinned CPU/GPU buffer pairs the same way
(`CpuGpuBuffer`); nano-vllm copies with `pin_memory().cuda(non_blocking=True)`.

`prepare_step` builds a step with prefill chunks as the reference's `prepare_lists` does, with numpy instead of a
Python loop over its tokens: a step of 8,192 tokens is 8,192 slots computed one by one in Python there, while the GPU
waits for them. vLLM builds its inputs the same way (numpy views of its CPU buffers, `_prepare_inputs`).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from minirt.attention import PagedAttentionMetadata
from minirt.config import cdiv
from minirt.model_runner import StepInputs

ALIGN = 16                 # int64 entries: each view of the buffer starts at a multiple of 128 bytes


def prepare_step(items: list, block_size: int) -> StepInputs:
    """`ModelRunner.prepare_lists(items)` with its per-token fields built by numpy: input_ids, positions and slots
    are int64 arrays `[num_tokens]`, and block_tables an int64 array `[num_seqs, W]`, each request's table cut or
    padded with block 0 to the W blocks of the step's longest context (`pad_block_tables`); the other fields are the
    reference's lists. Slot of position p: `table[p // block_size] * block_size + p % block_size`. Raises ValueError
    naming block_table where a request's table holds fewer blocks than its context needs."""
    num_seqs = len(items)
    counts = np.fromiter((n for _, n in items), np.int64, num_seqs)
    starts = np.fromiter((r.num_computed_tokens for r, _ in items), np.int64, num_seqs)
    ends = starts + counts
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    input_ids = np.fromiter(itertools.chain.from_iterable(
        r.token_ids[a:a + n] for (r, n), a in zip(items, starts.tolist())), np.int64, num_tokens)
    row = np.repeat(np.arange(num_seqs), counts)                       # each token's sequence
    positions = np.arange(num_tokens) + (starts - query_start_loc[:-1])[row]
    width = -(-int(ends.max()) // block_size)
    held = np.fromiter((len(r.block_table) for r, _ in items), np.int64, num_seqs)
    if (short := np.flatnonzero(held * block_size < ends)).size:     # the reference's slot lookup would fail there
        i = int(short[0])
        raise ValueError(f"block_table: {held[i]} blocks of {block_size} tokens hold fewer than the "
                         f"{ends[i]} tokens of request {items[i][0].request_id}'s context")
    lengths = np.minimum(held, width)
    block_tables = np.zeros((num_seqs, width), np.int64)
    block_tables[np.arange(width) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(
        r.block_table[:width] for r, _ in items), np.int64, int(lengths.sum()))
    slots = block_tables[row, positions // block_size] * block_size + positions % block_size
    known = np.fromiter((len(r.token_ids) for r, _ in items), np.int64, num_seqs)
    sampled = np.flatnonzero(ends == known)                          # chunks that reach the end of what is known
    return StepInputs(input_ids=input_ids, positions=positions, slots=slots,
                      query_start_loc=query_start_loc.tolist(), context_lens=ends.tolist(),
                      block_tables=block_tables, sample_rows=(query_start_loc[sampled + 1] - 1).tolist(),
                      sample_requests=[items[i][0] for i in sampled.tolist()], max_query_len=int(counts.max()))


class InputStaging:
    """One pinned host buffer and its device twin, grown as steps need, for `send`.

    The buffer is reused by every step: before it is written again, `send` waits for the copy of the step before to
    have read it (an event recorded after that copy; a step whose rows are all unsampled prefill chunks ends
    without any host sync, so the next one may come while its copy is queued)."""

    def __init__(self, device: torch.device, block_size: int):
        self.device, self.block_size = device, block_size
        self.host = self.buffer = None
        self.copied: torch.cuda.Event | None = None
        self.pin = device.type == "cuda"                      # elsewhere the copy is a plain one (tests on the CPU)

    def _reserve(self, n: int) -> None:
        if self.host is None or self.host.numel() < n:
            n = max(n, 2 * (0 if self.host is None else self.host.numel()))
            self.host = torch.empty(n, dtype=torch.long, pin_memory=self.pin)
            self.buffer = torch.empty(n, dtype=torch.long, device=self.device)

    def send(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, torch.Tensor]:
        """`(input_ids [1, N], positions [1, N], metadata, sample_rows [R])` on the device, as
        `ModelRunner.to_device` gives the first three (block tables `[num_seqs, W]`, W the blocks of the longest
        context, padded with block 0); sample_rows indexes the rows to sample. Views of the device buffer: valid
        until the next `send`, which they must not outlive (the runner's step uses them and is done)."""
        n, s, r = len(step.input_ids), len(step.context_lens), len(step.sample_rows)
        max_ctx = max(step.context_lens)
        width = cdiv(max_ctx, self.block_size)
        sizes = {"input_ids": n, "positions": n, "slots": n, "query_start_loc": s + 1, "context_lens": s,
                 "sample_rows": r}
        # Every view starts ALIGN entries (128 bytes) into the buffer: Triton compiles a kernel again for a
        # pointer argument that is not 16-byte aligned, and an unaligned view would cost a compile on first sight.
        starts = {}
        at = 0
        for name, size in sizes.items():
            starts[name] = at
            at += -(-size // ALIGN) * ALIGN
        total = at + s * width
        if self.copied is not None:
            self.copied.synchronize()                          # the step before's copy has read the buffer
        self._reserve(total)
        host = self.host.numpy()                               # a view: filling it fills the pinned buffer
        for name, size in sizes.items():
            host[starts[name]:starts[name] + size] = getattr(step, name)
        tables = host[at:at + s * width].reshape(s, width)
        if isinstance(step.block_tables, np.ndarray):                 # `prepare_step`'s, padded to this width
            tables[:] = step.block_tables
        else:
            for row, table in enumerate(step.block_tables):
                k = min(len(table), width)
                tables[row, :k] = table[:k]
                tables[row, k:] = 0
        self.buffer[:total].copy_(self.host[:total], non_blocking=self.pin)
        if self.pin:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))    # the stream the copy went to
        view = {name: self.buffer[starts[name]:starts[name] + size] for name, size in sizes.items()}
        meta = PagedAttentionMetadata(
            slot_mapping=view["slots"], query_start_loc=view["query_start_loc"], context_lens=view["context_lens"],
            block_tables=self.buffer[at:at + s * width].view(s, width), max_query_len=step.max_query_len,
            max_context_len=max_ctx)
        return view["input_ids"][None], view["positions"][None], meta, view["sample_rows"]
