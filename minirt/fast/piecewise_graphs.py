"""Piecewise CUDA graphs for steps with prefill chunks: everything but attention replayed, attention launched eagerly.

A step with prefill chunks (up to `max_num_batched_tokens` tokens, decodes mixed in) runs a few hundred kernels:
per layer the GEMMs, the compiled norms and SiLU, the rotary kernel and attention. Launched one by one from
Python (each `torch.compile` region checks its guards, each Triton kernel binds its arguments), they can take the
host longer than the GPU takes to run them (measured on the H200 by `benchmarks/profile_throughput.py`: without
these graphs, the steps with prefill chunks of the throughput workload are host-bound). A whole-step CUDA
graph cannot hold the attention kernel, whose grid and metadata follow the step's sequences; everything else
depends only on the token count.

So the forward is captured in *pieces*, cut at each attention call (vLLM's piecewise CUDA graphs, `cudagraph_mode
PIECEWISE` in `vllm/compilation/`; its `splitting_ops` are the attention ops): piece 0 runs from the embedding to
layer 0's attention, piece i from layer i-1's attention output to layer i's attention, the last piece to the final
norm. A step replays piece 0, launches layer 0's attention on the step's real metadata, replays piece 1, ... : for 28
layers, 29 replays and 28 attention calls (each an attention launch or two and a copy of its output), instead of
~360 launches.

A graph fixes the address and shape of every tensor it touches, so:

* a step of `T` tokens is padded to the next *capture size* (16, 32, ..., 512, then every 1024 up to
  `max_tokens`); padding tokens write their K/V into the scratch slot no request owns (as the decode graphs'
  padding rows do, `minirt.fast.cuda_graphs`) and never reach attention, which runs on the `T` real tokens;
* the token ids, positions and slot mapping live in static buffers; each piece ends by copying attention's inputs
  (q, or q/k/v when the backend writes K/V) into static buffers, and attention's output goes to one more, which the
  next piece reads. Every layer and every size shares these buffers, so the pieces keep no activation of theirs
  alive between replays.

All pieces of all sizes share one memory pool. That is safe because a step replays all the pieces of one size in
the order they were captured, and no tensor of the pool outlives a step but each size's last output.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from minirt.attention import PagedAttentionMetadata
from minirt.fast.attention import KernelPagedAttention
from minirt.fast.cuda_graphs import garbage_collector_off

MAX_TOKENS = 8192          # larger steps run eagerly: the pool and the static buffers grow with the largest size


def capture_sizes(max_tokens: int) -> list[int]:
    """Token counts with graphs: 16, 32, ..., 512 (small steps pay little padding), then every 1024 (at most 1/8 of a
    step of 8,192 tokens is padding), and `max_tokens` itself."""
    small = [s for s in (16, 32, 64, 128, 256, 512) if s < max_tokens]
    return small + list(range(1024, max_tokens, 1024)) + [max_tokens]


@dataclass
class _Call:
    """One attention call of the forward: the layer, its inputs (views of the static buffers holding q, or q/k/v when
    the backend writes K/V), and the static buffer its output goes to. `run(attn, num_tokens)` makes the call on the
    first `num_tokens` rows."""

    layer_idx: int
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor

    def run(self, attn: KernelPagedAttention, num_tokens: int) -> torch.Tensor:
        rows = [t[:, :num_tokens] for t in self.inputs]
        result = attn.attend(self.layer_idx, *rows) if len(rows) == 1 else attn(self.layer_idx, *rows)
        self.out[:, :num_tokens].copy_(result)
        return self.out


class _PieceAttention(KernelPagedAttention):
    """What the model attends with in a static-buffer forward: each call becomes a `_Call` handed to `on_call`, whose
    return value the layer goes on with. Its `meta.slot_mapping` is the static slot buffer, which the rotary kernel's
    K/V write reads inside the pieces."""

    def __init__(self, graphs: "PiecewiseGraphs", size: int, on_call: Callable[[_Call], torch.Tensor]):
        super().__init__(graphs.kv_cache, graphs.padding_meta(size), graphs.kernel, graphs.store)
        self.graphs, self.on_call = graphs, on_call

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.on_call(_Call(layer_idx, self.graphs.stage(q=q, k=k, v=v), self.graphs.out_buffer(q)))

    def attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        return self.on_call(_Call(layer_idx, self.graphs.stage(q=q), self.graphs.out_buffer(q)))


@dataclass
class _Pieces:
    """The graphs of one capture size, the attention calls between them, and the last piece's output."""

    graphs: list = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    output: torch.Tensor | None = None


class PiecewiseGraphs:
    """The pieces of one forward per capture size, with the static buffers they share.

    `run(input_ids, positions, attn)` takes a step's device inputs (`[T]` each, `T` at most `sizes[-1]`) and its
    attention backend (a `KernelPagedAttention` over the step's real metadata, whose `slot_mapping` is `[T]`) and
    returns the final hidden states `[T, hidden_size]`: a view of the last piece's output, which the next `run`
    overwrites. `capture=False` runs the same padded static-buffer forward eagerly, each attention call made where
    it stands: the padding and buffer logic, testable on a CPU with the torch reference kernel.

    `kernel`, `store`: the attention kernel and K/V write (see `KernelPagedAttention`); `scratch_block`: the block
    padding tokens write K/V to.
    """

    def __init__(self, model, kv_cache: torch.Tensor, kernel, store, max_tokens: int, scratch_block: int,
                 capture: bool = True):
        self.model, self.kv_cache, self.kernel, self.store = model, kv_cache, kernel, store
        self.sizes = capture_sizes(max_tokens)
        n, dev = self.sizes[-1], model.device
        self.scratch_slot = scratch_block * kv_cache.shape[3]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        cfg = model.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rows = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim, "out": heads * head_dim}
        self.buffers = {name: torch.zeros(n * width, dtype=model.dtype, device=dev) for name, width in rows.items()}
        self.pieces: dict[int, _Pieces] = {}
        self.captured = False
        if capture:
            self.capture()

    def stage(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy attention's inputs (q, k, v, each `[1, size, heads, D]`) into their static buffers; returns the
        buffers' views, in the order given. Inside a capture the copies end the piece."""
        views = []
        for name, t in inputs.items():
            view = self.buffers[name][:t.numel()].view(t.shape)
            views.append(view.copy_(t))
        return tuple(views)

    def out_buffer(self, q: torch.Tensor) -> torch.Tensor:
        """The static buffer attention writes into, shaped like q `[1, size, H, D]`."""
        return self.buffers["out"][:q.numel()].view(q.shape)

    def padding_meta(self, size: int) -> PagedAttentionMetadata:
        """Metadata of one sequence of `size` new tokens on the scratch block: what the warm-up forward attends with (a
        launch of the kind steps with prefill chunks make: one program per sequence, no split-KV). Its slot mapping
        is the static slot buffer, which `capture` fills with the scratch slot before the warm-ups."""
        dev, block_size = self.input_ids.device, self.kv_cache.shape[3]
        return PagedAttentionMetadata(
            slot_mapping=self.slots[:size], query_start_loc=torch.tensor([0, size], device=dev),
            context_lens=torch.tensor([size], device=dev),
            block_tables=torch.full((1, -(-size // block_size)), self.scratch_slot // block_size, dtype=torch.long,
                                    device=dev),
            max_query_len=size, max_context_len=size)

    def _forward(self, size: int, attn: "_PieceAttention") -> torch.Tensor:
        return self.model(self.input_ids[:size][None], self.positions[:size][None], attn=attn)[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all pieces in one memory pool, on a side stream (a capture cannot run on
        the default stream), with the garbage collector off (`garbage_collector_off`; why: `DecodeGraphs.capture`)."""
        pool = torch.cuda.graph_pool_handle()                 # one pool for every piece of every size
        stream = torch.cuda.Stream()
        self.slots.fill_(self.scratch_slot)                   # the warm-ups write K/V through the static slots
        with garbage_collector_off():
            for size in reversed(self.sizes):
                padding = KernelPagedAttention(self.kv_cache, self.padding_meta(size), self.kernel, self.store)
                self._forward(size, _PieceAttention(self, size, lambda call: call.run(padding, size)))   # warm-up:
                torch.cuda.synchronize()                      # Triton compiles, cuBLAS picks its kernels
                self.pieces[size] = self._capture_pieces(size, pool, stream)
        torch.cuda.synchronize()
        self.captured = True

    def _capture_pieces(self, size: int, pool, stream: torch.cuda.Stream) -> _Pieces:
        """One size's pieces, captured on `stream` into `pool`. A capture that fails is ended before the error
        propagates, as `torch.cuda.graph` does: a stream left capturing would fail every later allocation."""
        pieces = _Pieces()

        def begin() -> None:
            pieces.graphs.append(torch.cuda.CUDAGraph())
            pieces.graphs[-1].capture_begin(pool=pool)

        def cut(call: _Call) -> torch.Tensor:
            pieces.graphs[-1].capture_end()
            pieces.calls.append(call)
            begin()
            return call.out

        attn = _PieceAttention(self, size, cut)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            begin()
            try:
                pieces.output = self._forward(size, attn)
            except BaseException:
                with contextlib.suppress(RuntimeError):       # an invalidated capture: ending it is all we need
                    pieces.graphs[-1].capture_end()
                raise
            pieces.graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return pieces

    def size_for(self, num_tokens: int) -> int:
        """The capture size a step of num_tokens tokens is padded to. Raises ValueError naming num_tokens above the
        largest size (the runner sends such steps through the eager forward instead)."""
        if not 1 <= num_tokens <= self.sizes[-1]:
            raise ValueError(f"num_tokens: {num_tokens} is not in 1 .. {self.sizes[-1]} (the largest capture size)")
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: KernelPagedAttention) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        size = self.size_for(num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slots[:num_tokens].copy_(attn.meta.slot_mapping)
        self.slots[num_tokens:size].fill_(self.scratch_slot)    # padding: K/V into the scratch slot
        if not self.captured:                                    # capture=False: the same forward, eagerly
            return self._forward(size, _PieceAttention(self, size, lambda call: call.run(attn, num_tokens)))[:num_tokens]
        pieces = self.pieces[size]
        for graph, call in zip(pieces.graphs, pieces.calls):
            graph.replay()
            call.run(attn, num_tokens)
        pieces.graphs[-1].replay()
        return pieces.output[:num_tokens]
