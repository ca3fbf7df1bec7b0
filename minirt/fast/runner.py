"""The model runner of the fast path: the plan's attention kernel, CUDA graphs for decode steps and for speculative
decoding's verification steps, piecewise graphs for steps with prefill chunks, and multi-step decode's bursts
(`FastModelRunner`), built once from a plan by `build_model_runner`."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from minirt.attention import PagedAttentionMetadata
from minirt.config import cdiv
from minirt.fast.attention import KernelPagedAttention, attention_kernels, verify_kernel
from minirt.fast.cuda_graphs import DecodeGraphs, capture_sizes
from minirt.fast.layers import speed_up_model
from minirt.fast.piecewise_graphs import MAX_TOKENS, PiecewiseGraphs
from minirt.fast.staging import InputStaging, prepare_step
from minirt.kv.paged_cache import allocate_kv_cache
from minirt.model.decoder import DecoderModel
from minirt.model_runner import ModelRunner, StepInputs, pad_block_tables
from minirt.request import Request
from minirt.sampling import sample


class FastModelRunner(ModelRunner):
    """`ModelRunner` whose steps attend with `kernel` and `store` (see `KernelPagedAttention`) and, where
    `decode_graphs` is given (a `DecodeGraphs`), replay a CUDA graph for steps in which every sequence has one
    new token, and where `piecewise_graphs` is given (a `PiecewiseGraphs`), replay the pieces of the other steps up
    to its largest size, attention launched between them; `execute_decode_steps` runs several decode steps back to
    back, moving their inputs on with `advance` (`advance_decode_inputs`' contract; that function if None). Where
    `verify_graphs` is given (a `DecodeGraphs` of query length k + 1), `forward_verify` replays them for speculative
    decoding's verification steps."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int, kernel, store,
                 decode_graphs: DecodeGraphs | None = None, piecewise_graphs: PiecewiseGraphs | None = None,
                 advance: Callable | None = None, verify_graphs: DecodeGraphs | None = None):
        super().__init__(model, kv_cache, block_size)
        self.kernel, self.store = kernel, store
        self.advance = advance or advance_decode_inputs   # a burst's inputs from step to step (its contract)
        self.staging = InputStaging(self.device, block_size)
        self.decode_graphs, self.piecewise_graphs = decode_graphs, piecewise_graphs
        self.verify_graphs = verify_graphs
        self.sample_sizes: list[int] = []       # the greedy sampler's row counts (`padded_rows`); none: no padding
        self.greedy_head = None                 # a `GreedyGemvHead`: greedy one-row steps take its argmax

    def attention(self, meta) -> KernelPagedAttention:
        return KernelPagedAttention(self.kv_cache, meta, self.kernel, self.store)

    def prepare_lists(self, items: list[tuple[Request, int]]) -> StepInputs:
        """A step with a prefill chunk of two or more tokens through `prepare_step` (numpy arrays; what
        `InputStaging.send` copies); the others (the decode graphs and bursts take them) as the reference builds them."""
        if all(n == 1 for _, n in items):
            return super().prepare_lists(items)
        return prepare_step(items, self.block_size)

    def forward(self, step: StepInputs, fill: Callable | None = None) -> torch.Tensor:
        """Hidden states `[num_sampled, hidden]` of the sampled rows: through a decode graph where there is one for
        the step, else through the piecewise graphs (a step with prefill chunks, `minirt.fast.piecewise_graphs`) up to
        their largest size, else eagerly; the inputs go in one asynchronous copy (`InputStaging`). `fill` (given by
        `launch_step`, which never takes the decode-graph path) writes tokens the host does not have yet into the
        device's input ids `[num_tokens]` before the forward reads them."""
        hidden = self.forward_decode_graph(step) if fill is None else None
        if hidden is not None:
            return hidden
        input_ids, positions, meta, rows = self.staging.send(step)
        if fill is not None:
            fill(input_ids[0])
        graphs = self.piecewise_graphs
        if graphs is not None and len(step.input_ids) <= graphs.sizes[-1]:
            hidden = graphs.run(input_ids[0], positions[0], self.attention(meta))
        else:
            hidden = self.model(input_ids, positions, attn=self.attention(meta))[0]
        return hidden[rows]

    def forward_verify(self, step: StepInputs) -> torch.Tensor:
        """`forward` for a verification step of speculative decoding whose sequences are all running requests, a
        request's last token and its draft (no prefill chunk: `minirt.spec.engine.SpeculativeSteps.verify` decides):
        through `verify_graphs`, every sequence padded to their k + 1 rows, where the step fits them (at most k + 1
        rows per sequence, at most their largest batch size) and some request has a draft; else `forward` (a step
        without drafts replays the decode graphs). Hidden states `[num_sampled, hidden]` of `step.sample_rows`."""
        graphs = self.verify_graphs
        if (graphs is None or not 1 < step.max_query_len <= graphs.query_len
                or len(step.context_lens) > graphs.sizes[-1]):
            return self.forward(step)
        return graphs.run_padded(step)

    def to_device(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """`ModelRunner.to_device`'s tensors, as views of `InputStaging`'s buffer, valid until the next step's."""
        return self.staging.send(step)[:3]

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
        block tables already hold `num_steps` new tokens (`minirt.fast.multi_step.BurstScheduler.decode_steps_ahead`).
        Returns the requests and their tokens, `[num_steps][num_requests]`; a request that ends part-way (EOS, a stop
        string, its last token) gets tokens past its end, which the engine drops. Raises ValueError if an item is not
        a decode. The same as `finish_decode_steps(start_decode_steps(items, num_steps))`.
        """
        return self.finish_decode_steps(self.start_decode_steps(items, num_steps))

    @torch.inference_mode()
    def start_decode_steps(self, items: list[tuple[Request, int]], num_steps: int) -> "DecodeBurst":
        """Launch `execute_decode_steps`' steps and return at once, before the GPU has run them: a `DecodeBurst`
        whose tokens `finish_decode_steps` reads, and which `continue_decode_steps` can extend first."""
        step = self.prepare_lists(items)
        requests = step.sample_requests
        if step.max_query_len != 1 or len(requests) != len(items):
            raise ValueError("execute_decode_steps: every item must be a decode (one new token, sampled)")
        graphs, num_seqs = self.decode_graphs, len(items)
        if graphs is not None and num_seqs <= graphs.sizes[-1]:
            hidden = graphs.run(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
            burst = DecodeBurst(requests, graphs.inputs(num_seqs), functools.partial(graphs.replay, num_seqs))
        else:
            input_ids, positions, meta = self.to_device(step)
            meta.block_tables = self._block_tables(requests, meta.max_context_len + num_steps - 1)
            attn = self.attention(meta)
            hidden = self.model(input_ids, positions, attn=attn)[0]

            def forward():
                meta.max_context_len += 1
                return self.model(input_ids, positions, attn=attn)[0]

            burst = DecodeBurst(requests, [input_ids[0], positions[0], meta.slot_mapping, meta.context_lens,
                                           meta.block_tables], forward, meta)
        burst.sample = self._sampler(requests)                            # once per burst
        burst.tokens.append(burst.sample(hidden))
        self._more_steps(burst, burst.tokens[-1], num_steps - 1)
        self._read_back(burst)
        return burst

    @torch.inference_mode()
    def continue_decode_steps(self, burst: "DecodeBurst", num_steps: int) -> "DecodeBurst":
        """Launch `num_steps` more decode steps of `burst`'s requests after its last, before its tokens are read:
        the GPU goes on from the inputs `burst` left on the device while the host takes `burst`'s tokens
        (`minirt.fast.multi_step.BurstSteps`, overlap scheduling). Each request's block table must already hold blocks
        for the new steps; the device's copy of the tables is refreshed from them first. Returns the new burst."""
        after = DecodeBurst(burst.requests, burst.inputs, burst.forward, burst.meta, burst.sample)
        if burst.meta is None:
            self.decode_graphs.update_tables([r.block_table for r in burst.requests])
        else:
            tables = self._block_tables(burst.requests, burst.meta.max_context_len + num_steps)
            burst.meta.block_tables = after.inputs[4] = tables
        self._more_steps(after, burst.tokens[-1], num_steps)
        self._read_back(after)
        return after

    def finish_decode_steps(self, burst: "DecodeBurst") -> tuple[list[Request], list[list[int]]]:
        """The burst's requests and their tokens, `[num_steps][num_requests]`: waits for the GPU to have run the
        burst, not what was launched after it."""
        return _taken(burst.requests, burst.host_tokens, burst.copied)

    def _read_back(self, burst: "DecodeBurst") -> None:
        """Queue the copy of the burst's tokens to the host right behind its last step, before anything launched
        after it (overlap scheduling's next burst): `finish_decode_steps` then waits for this burst alone, and the
        host takes its tokens while the GPU runs the next one. A copy queued only when the tokens are read would
        wait for the next burst as well, and the GPU would sit idle while the host takes them."""
        burst.host_tokens, burst.copied = self._to_host(torch.stack(burst.tokens))

    def _to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """An asynchronous copy of `tokens` on the host and an event after it (on CUDA; elsewhere the tokens
        themselves and None)."""
        if self.device.type != "cuda":
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return host, copied

    @torch.inference_mode()
    def launch_step(self, items: list[tuple[Request, int]], previous: "StepInFlight | None" = None
                   ) -> "StepInFlight":
        """Launch one step (`ModelRunner.execute`'s) and return before the GPU has run it: a `StepInFlight` whose
        tokens `finish_step` reads. With `previous`, a step launched before and not read yet (async scheduling,
        `minirt.fast.async_scheduling`), the requests it samples have one token more than their `token_ids` hold:
        the one `previous` computes. Their rows of this step read it on the device, where `previous` left it.

        The step must not take the decode-graph path (a step with a prefill chunk of 2 or more tokens never does);
        raises ValueError otherwise."""
        pending = {} if previous is None else {r: i for i, r in enumerate(previous.requests) if not r.is_finished}
        for request in pending:
            request.token_ids.append(0)          # a stand-in for the token `previous` computes, replaced on device
        try:
            step = self.prepare_lists(items)
            rows, sources = [], []
            for (request, n), start in zip(items, step.query_start_loc):
                last = len(request.token_ids) - 1
                if request in pending and request.num_computed_tokens <= last < request.num_computed_tokens + n:
                    rows.append(start + last - request.num_computed_tokens)
                    sources.append(pending[request])
        finally:
            for request in pending:
                request.token_ids.pop()
        if step.max_query_len < 2:
            raise ValueError("launch_step: a step of one-token rows goes through the decode graphs; use execute")
        fill = None
        if rows:
            index = torch.tensor([rows, sources])
            index = index.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else index
            fill = functools.partial(_fill_rows, index, previous.tokens)
        hidden = self.forward(step, fill)
        requests = step.sample_requests
        tokens = self.sample(hidden, requests) if requests else torch.empty(0, dtype=torch.long, device=self.device)
        return StepInFlight(requests, tokens, *self._to_host(tokens))

    def finish_step(self, step: "StepInFlight") -> tuple[list[Request], list[int]]:
        """The step's sampled requests and their tokens (waits for the GPU to have run that step, no more)."""
        return _taken(step.requests, step.host_tokens, step.copied)

    def _block_tables(self, requests: list[Request], max_context_len: int) -> torch.Tensor:
        """The requests' block tables on the device, padded to the blocks of `max_context_len` tokens."""
        width = cdiv(max_context_len, self.block_size)
        tables = torch.tensor(pad_block_tables([r.block_table for r in requests], width))
        if self.device.type != "cuda":
            return tables.to(self.device)
        return tables.pin_memory().to(self.device, non_blocking=True)     # no wait for the steps in flight

    def sample(self, hidden: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`ModelRunner.sample`, greedy batches padded as `_sampler` pads them."""
        return self._sampler(requests)(hidden)

    def _sampler(self, requests: list[Request]):
        """hidden `[num_requests, hidden]` -> next tokens `[num_requests]`: `ModelRunner.sample` with its tensors
        built once. A greedy batch's rows are padded with zeros to the next of `sample_sizes` (`padded_rows`): the
        LM head's GEMM then runs at shapes `warm_up_sampler` has run before. On its first call at a new shape cuBLAS
        loads and picks its kernel, and the host waits there for every kernel queued before (a step's whole forward),
        while it should be preparing the next step."""
        tensors = self.sampling_tensors(requests)
        generators = [r.generator for r in requests]

        def next_tokens(hidden):
            if tensors is None:     # greedy: the argmax of the logits in the model's dtype is the argmax of their
                rows = hidden.shape[0]                              # float32 copy (exact), without the copy
                if rows == 1 and self.greedy_head is not None:
                    return self.greedy_head.greedy(hidden)          # in the LM head's epilogue (argmax_in_gemv)
                padded = padded_rows(rows, self.sample_sizes)
                if padded != rows:
                    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, padded - rows))
                return self.model.lm_head(hidden).argmax(dim=-1)[:rows]
            return sample(self.model.compute_logits(hidden), *tensors, generators)

        return next_tokens

    @torch.inference_mode()
    def warm_up_sampler(self) -> None:
        """Run the greedy sampler's LM head and argmax once at every size of `sample_sizes` (vLLM's
        `_dummy_sampler_run` warms its sampler at start-up the same way)."""
        for size in self.sample_sizes:
            hidden = torch.zeros(size, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
            self.model.lm_head(hidden).argmax(dim=-1)

    def _more_steps(self, burst: "DecodeBurst", last: torch.Tensor, num_steps: int) -> None:
        """Launch `num_steps` steps of `burst`, the first one's inputs made from the tokens `last`."""
        for _ in range(num_steps):
            self.advance(last, *burst.inputs, self.block_size)
            last = burst.sample(burst.forward())
            burst.tokens.append(last)


@dataclass
class DecodeBurst:
    """Decode steps launched and not yet read: the requests, one `[num_requests]` token tensor per step (on the
    device), the device inputs the steps advance (input ids, positions, slot mapping, context lengths, block
    tables), the forward that runs one more step on them, the eager path's metadata (None for CUDA graphs), the
    sampler, and once every step is launched, the tokens' copy on the host `[num_steps, num_requests]` and an event
    after the copy (None off CUDA, where the copy is the tokens themselves)."""

    requests: list[Request]
    inputs: list
    forward: Callable[[], torch.Tensor]
    meta: object = None
    sample: Callable | None = None
    tokens: list[torch.Tensor] = field(default_factory=list)
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


def _taken(requests: list[Request], host_tokens: torch.Tensor, copied) -> tuple[list[Request], list]:
    """The requests and their tokens as lists, once the tokens' copy to the host (`_to_host`) is done."""
    if copied is not None:
        copied.synchronize()
    return requests, host_tokens.tolist()


def _fill_rows(index: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor) -> None:
    """`input_ids[index[0][i]] = tokens[index[1][i]]` for every i, on the device."""
    input_ids[index[0]] = tokens[index[1]]


@dataclass
class StepInFlight:
    """A step launched and not yet read (`FastModelRunner.launch_step`): its sampled requests, their tokens on the
    device `[num_sampled]`, the tokens' copy on the host and an event after the copy (None off CUDA)."""

    requests: list[Request]
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    copied: torch.cuda.Event | None = None


def padded_rows(rows: int, sizes: list[int]) -> int:
    """The smallest of `sizes` (ascending) that holds `rows`, or `rows` itself when none does."""
    at = bisect.bisect_left(sizes, rows)
    return sizes[at] if at < len(sizes) else rows


def advance_decode_inputs(next_ids: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          block_size: int) -> None:
    """Turn one decode step's device inputs into the next step's, in place, with no host work.

    next_ids, input_ids, positions, slot_mapping, context_lens `[num_seqs]` int64; block_tables
    `[num_seqs, max_blocks]`, which must already hold the blocks of the next positions. The sampled tokens
    become the inputs, positions and context lengths move on by one, and each slot is looked up in the block
    table on the device: `block_tables[s, p // block_size] * block_size + p % block_size`. Eagerly these are nine
    small kernels for every step of a burst; where the plan fuses ops, the runner runs this function compiled
    (`minirt.fast.ops.fused`): three.
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
                       max_model_len: int, max_num_batched_tokens: int = MAX_TOKENS) -> ModelRunner:
    """The engine's model runner for a plan (`minirt.fast.plan.Plan`), with its KV cache of `num_kv_blocks` blocks
    (`FastEngine.build_model_runner`; chapter 09's ranks build theirs from `fast_parts`).

    For the reference plan, chapter 05's `ModelRunner` over the model as loaded. Otherwise the plan's fast modules
    are swapped into the model (`speed_up_model`), and a `FastModelRunner` gets the plan's attention kernels and,
    with CUDA graphs, one more KV block than the pool hands out: the scratch block padding rows write to; with
    piecewise graphs, pieces for steps of up to `min(max_num_batched_tokens, MAX_TOKENS)` tokens; with verify_graphs,
    graphs of k + 1 rows per sequence for verification steps of up to `speculative_max_batch` requests
    (`build_verify_graphs`); with fused ops and bursts, `advance_decode_inputs` compiled; with argmax_in_gemv, greedy
    one-row steps sampled by the LM head (`GreedyGemvHead.greedy`).
    """
    if plan.is_reference:
        return ModelRunner(model, allocate_kv_cache(model.config, num_kv_blocks, block_size, model.dtype,
                                                    model.device), block_size)
    kv_cache, kernel, store = fast_parts(plan, model, num_kv_blocks, block_size, max_num_seqs)
    graphs = None
    if plan.cuda_graphs:
        graphs = DecodeGraphs(model, kv_cache, kernel, store, max_num_seqs, cdiv(max_model_len, block_size),
                              scratch_block=num_kv_blocks)
    pieces = None
    if plan.piecewise_graphs:
        pieces = PiecewiseGraphs(model, kv_cache, kernel, store, min(max_num_batched_tokens, MAX_TOKENS),
                                 scratch_block=num_kv_blocks)
    verify = None
    if plan.verify_graphs:
        verify = build_verify_graphs(plan, model, kv_cache, kernel, store,
                                     min(plan.speculative_max_batch, max_num_seqs), max_model_len, num_kv_blocks)
    advance = None
    if plan.fused_ops and plan.num_scheduler_steps > 1:
        from minirt.fast.ops import fused

        advance = fused(advance_decode_inputs)
    runner = FastModelRunner(model, kv_cache, block_size, kernel, store, graphs, pieces, advance, verify)
    if plan.argmax_in_gemv:
        runner.greedy_head = model.lm_head
    if model.device.type == "cuda":       # (not for tensor parallelism: its other ranks run the LM head unpadded)
        runner.sample_sizes = capture_sizes(max_num_seqs)       # the decode graphs' batch sizes
        runner.warm_up_sampler()
    return runner


def build_verify_graphs(plan, model: DecoderModel, kv_cache: torch.Tensor, kernel, store, max_num_seqs: int,
                        max_model_len: int, scratch_block: int, capture: bool = True) -> DecodeGraphs:
    """The CUDA graphs of speculative decoding's verification steps for a plan (`minirt.fast.plan.Plan`, its
    num_speculative_tokens k): `DecodeGraphs` of query length k + 1 at the capture sizes up to `max_num_seqs`
    sequences (vLLM's "uniform decode" graphs, `uniform_decode_query_len = 1 + num_spec_tokens`), attending with
    `verify_kernel` (split-KV for their few rows per sequence); `kernel`, `store`: the plan's (`fast_parts`), the
    padding rows writing the scratch block `scratch_block` of `kv_cache`."""
    block_size, query_len = kv_cache.shape[3], 1 + plan.num_speculative_tokens
    kernel = verify_kernel(plan, kernel, max_num_seqs, query_len, model.config.num_key_value_heads, model.device)
    return DecodeGraphs(model, kv_cache, kernel, store, max_num_seqs, cdiv(max_model_len, block_size), scratch_block,
                        capture=capture, query_len=query_len)
