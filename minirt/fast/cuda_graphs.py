"""CUDA graphs for decode and verification steps: the whole forward replayed with one launch.

A decode step of a small model is *launch-bound*: every layer is dozens of small kernels, and the CPU takes longer to
launch them than the GPU takes to run them. A CUDA graph records the kernel launches of one forward once and replays
them all with a single call (vLLM's `CUDAGraphRunner`, nano-vllm's `ModelRunner.capture_cudagraph`; NVIDIA, "CUDA C++
Programming Guide", section "CUDA Graphs"). A graph fixes the address and the shape of every tensor it touches, so:

* batches are padded up to the next *capture size* (1, 2, 4, 8, then every 16 up to `max_num_seqs`), and each
  sequence to the graphs' query length q: 1 for decode steps, k + 1 for speculative decoding's verification steps;
* the inputs - token ids, positions, slot mapping, context lengths, block tables - live in static buffers;
* padding rows (of padding sequences, or past a sequence's real rows) write their K/V into a scratch slot no
  request owns (one extra block at the end of the KV tensor); their outputs are dropped.

Only the Triton and flash-attn kernels can be captured: the torch reference keeps the real query rows with a boolean
mask (`out[q_valid]`), whose result size depends on the data, and a captured graph cannot allocate data-dependent
shapes. Steps with prefill chunks, whose attention follows their sequences, replay piecewise graphs instead (up to
8,192 tokens, with `piecewise_graphs` on), attention launched between the pieces (`minirt.fast.piecewise_graphs`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc

import numpy as np
import torch

from minirt.attention import PagedAttentionMetadata
from minirt.config import cdiv
from minirt.fast.attention import KernelPagedAttention
from minirt.model_runner import StepInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a graph: 1, 2, 4, 8, 16, 32, 48, ... and `max_num_seqs` itself (nano-vllm's list;
    vLLM's default steps by 8)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """One captured forward per capture size, every sequence with `query_len` new tokens (q; 1: decode steps), with
    the static input buffers they share.

    `run(input_ids, positions, slots, context_lens, block_tables)` (q = 1) takes the host lists of a step in which
    every sequence has one new token (`num_seqs` entries each; `block_tables` a list of lists) and returns
    the hidden states `[num_seqs, hidden_size]`: a view of the graph's output buffer, which the next `run`
    overwrites. `num_seqs` must be at most `max_num_seqs`; block tables at most `max_blocks_per_seq` long.
    Multi-step decode (`minirt.fast.runner.FastModelRunner.execute_decode_steps`) moves the buffers on by one step
    on the device (`inputs`) and replays again (`replay`), without the host copy.

    `run_padded(step)` takes a step whose sequences have 1 to q new tokens each (speculative decoding's verification
    of drafts of up to k = q - 1 tokens, `minirt.spec.engine.SpeculativeSteps.verify`) and pads each sequence to q
    rows. A sequence's padding rows follow its real ones: they write the scratch slot, are never sampled, and its
    context length counts them, so that each row stands at its position (row j at `context_len - q + j`, where the
    kernels place a sequence's rows). Their keys past the real ones are read through the block table's entries
    there, whatever those hold (a block id the pool handed out earlier, or the scratch block: the pool is
    zero-filled and every K/V written is finite), and every real row masks them out (causal mask); the tables
    have room for them (`cdiv(q - 1, block_size)` entries more than `max_blocks_per_seq`).

    `kernel`, `store`: the paged-attention kernel and K/V write (see `minirt.fast.attention.KernelPagedAttention`).
    `capture=False` runs the same padded static-buffer forward eagerly instead of replaying a graph: the
    padding and buffer logic, testable on a CPU with the torch reference kernel.
    """

    def __init__(self, model, kv_cache: torch.Tensor, kernel, store, max_num_seqs: int, max_blocks_per_seq: int,
                 scratch_block: int, capture: bool = True, query_len: int = 1):
        self.model, self.kv_cache, self.kernel, self.store = model, kv_cache, kernel, store
        self.sizes = capture_sizes(max_num_seqs)
        self.query_len = q = query_len
        self.block_size = block_size = kv_cache.shape[3]
        self.max_blocks_per_seq = max_blocks_per_seq = max_blocks_per_seq + cdiv(q - 1, block_size)
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.max_context_len = max_blocks_per_seq * block_size
        n, dev = max_num_seqs, model.device
        # One host staging buffer (pinned: the copy to the device runs asynchronously) and its device twin,
        # each viewed as `vectors` [5, w] (rows: input ids, positions, slot mapping, the sequences' context lengths,
        # the rows `run_padded` samples; w: n * q rounded up to 16 entries, so that every row starts 128-byte aligned)
        # followed by `tables` [n, max_blocks_per_seq]. A step of `size` sequences copies the vectors and the first
        # `size` tables: one contiguous copy.
        w = -(-n * q // 16) * 16
        pin = dev.type == "cuda"
        self.host_buffer = torch.zeros(5 * w + n * max_blocks_per_seq, dtype=torch.long, pin_memory=pin)
        self.host_vectors = self.host_buffer[:5 * w].view(5, w)
        self.host_tables = self.host_buffer[5 * w:].view(n, max_blocks_per_seq)
        self.host_tables.fill_(scratch_block)
        self.host_vectors[2] = self.scratch_slot                   # until the first step: every row is padding,
        self.host_vectors[3] = q                                   # each sequence's q rows at positions 0 .. q-1
        self.buffer = self.host_buffer.to(dev, copy=True)
        self.vectors = self.buffer[:5 * w].view(5, w)
        self.tables = self.buffer[5 * w:].view(n, max_blocks_per_seq)
        self.query_start_loc = torch.arange(n + 1, device=dev) * q   # q tokens per sequence (padding ones too)
        # Recorded after each step's copies: the next step may refill the pinned buffers only once the copies
        # have read them (a step whose rows are all unsampled prefill chunks ends without a host sync).
        self.copies_done = torch.cuda.Event() if pin else None
        self.copies_pending = False
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    def _forward(self, size: int) -> torch.Tensor:
        v, num_tokens = self.vectors, size * self.query_len
        meta = PagedAttentionMetadata(
            slot_mapping=v[2, :num_tokens], query_start_loc=self.query_start_loc[:size + 1],
            context_lens=v[3, :size], block_tables=self.tables[:size], max_query_len=self.query_len,
            max_context_len=self.max_context_len)
        attn = KernelPagedAttention(self.kv_cache, meta, self.kernel, self.store)
        return self.model(v[0, :num_tokens][None], v[1, :num_tokens][None], attn=attn)[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (the smaller graphs reuse its blocks).

        The garbage collector is off while capturing (vLLM's `freeze_gc` does the same): a collection that
        frees an earlier engine's graph mid-capture would call its `reset`, which a capturing stream refuses,
        and the capture would fail with `cudaErrorStreamCaptureInvalidated`."""
        pool = None
        with garbage_collector_off():
            for size in reversed(self.sizes):
                self._forward(size)                                # warm-up: Triton compiles, cuBLAS picks kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        num_seqs = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        if self.copies_pending:
            self.copies_done.synchronize()
        hv, ht = self.host_vectors.numpy(), self.host_tables.numpy()     # views: filling them fills the pinned buffers
        hv[0, :num_seqs] = input_ids
        hv[1, :num_seqs] = positions
        hv[2, :num_seqs] = slots
        hv[3, :num_seqs] = context_lens
        hv[:2, num_seqs:size] = 0
        hv[2, num_seqs:size] = self.scratch_slot                   # padding rows: one token that writes the scratch
        hv[3, num_seqs:size] = 1                                   # slot and attends to itself there
        ht[num_seqs:size, 0] = self.scratch_block
        self._send(block_tables, size, start=0)
        return self.replay(num_seqs)

    def run_padded(self, step: StepInputs) -> torch.Tensor:
        """The hidden states `[len(step.sample_rows), hidden_size]` of a step's sampled rows (`StepInputs`, its
        per-token fields lists or arrays), every sequence padded to `query_len` rows (see the class docstring), through
        the graph of the next capture size. The sampled rows are gathered from the graph's output by an index that
        travels in the same host copy as the inputs. Raises ValueError naming step where a sequence has more than
        `query_len` new tokens or there are more sequences than the largest capture size."""
        q, num_seqs = self.query_len, len(step.context_lens)
        starts = np.asarray(step.query_start_loc)
        counts = np.diff(starts)
        if num_seqs > self.sizes[-1] or counts.max() > q:
            raise ValueError(f"step: {num_seqs} sequences of up to {counts.max()} new tokens; these graphs take up to "
                             f"{self.sizes[-1]} sequences of up to {q}")
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        if self.copies_pending:
            self.copies_done.synchronize()
        hv, ht = self.host_vectors.numpy(), self.host_tables.numpy()     # views: filling them fills the pinned buffers
        rows = np.arange(starts[-1]) + np.repeat(np.arange(num_seqs) * q - starts[:-1], counts)   # each token's row
        hv[:2, :size * q] = 0                                      # padding rows: token 0 at position 0, writing
        hv[2, :size * q] = self.scratch_slot                       # the scratch slot
        hv[0, rows] = step.input_ids
        hv[1, rows] = step.positions
        hv[2, rows] = step.slots
        hv[3, :num_seqs] = np.asarray(step.context_lens) - counts + q
        hv[3, num_seqs:size] = q                                   # padding sequences: q rows on the scratch block
        ht[num_seqs:size, :cdiv(q, self.block_size)] = self.scratch_block
        sampled = rows[step.sample_rows]
        hv[4, :len(sampled)] = sampled
        self._send(step.block_tables, size, start=0)
        return self.replay(num_seqs).index_select(0, self.vectors[4, :len(sampled)])

    def update_tables(self, block_tables: list[list[int]]) -> None:
        """Copy the block tables of the first `len(block_tables)` rows to the device again, and nothing else: the
        other inputs stay as the steps on the device left them (a continued burst, `minirt.fast.multi_step`).
        The copy is queued after the work already on the stream, so steps in flight read the old tables."""
        if self.copies_pending:
            self.copies_done.synchronize()
        self._send(block_tables, self.sizes[bisect.bisect_left(self.sizes, len(block_tables))],
                   start=self.host_vectors.numel())

    def _send(self, block_tables: list[list[int]], size: int, start: int) -> None:
        """Write the rows' block tables into the pinned buffer, then copy its entries from `start` to the end of
        the tables of `size` rows to the device, asynchronously; the event marks when the copy has read them."""
        ht = self.host_tables.numpy()                              # a view: filling it fills the pinned buffer
        for row, table in enumerate(block_tables):
            ht[row, :len(table)] = table                           # entries past a row's context are never read
        end = self.host_vectors.numel() + size * self.max_blocks_per_seq
        self.buffer[start:end].copy_(self.host_buffer[start:end], non_blocking=True)
        if self.copies_done is not None:
            self.copies_done.record(torch.cuda.current_stream(self.buffer.device))   # the stream the copy went to
            self.copies_pending = True

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Run the forward of `num_seqs` sequences on the static buffers as they stand (`run` and `run_padded` fill
        them from the host; `minirt.fast.runner.advance_decode_inputs` moves them on by one step on the device).
        Returns the hidden states `[num_seqs * query_len, hidden_size]`, a view that the next replay overwrites."""
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        if not self.graphs:                                        # capture=False
            return self._forward(size)[:num_seqs * self.query_len]
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs * self.query_len]

    def inputs(self, num_seqs: int) -> tuple[torch.Tensor, ...]:
        """The first `num_seqs` rows of the static inputs (query_len 1), as views: `(input_ids, positions,
        slot_mapping, context_lens)` `[num_seqs]` each and `block_tables` `[num_seqs, max_blocks_per_seq]`."""
        return (*self.vectors[:4, :num_seqs], self.tables[:num_seqs])


@contextlib.contextmanager
def garbage_collector_off():
    """One collection, then the garbage collector off until the block ends (as it was before, after): what graph
    captures run under (`DecodeGraphs.capture`, `minirt.fast.piecewise_graphs.PiecewiseGraphs.capture`)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
