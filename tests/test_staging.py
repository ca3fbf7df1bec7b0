"""The fast runner's one-copy inputs (minirt.fast.staging.InputStaging) against the reference runner's `to_device`.

Oracle: `minirt.model_runner.ModelRunner.to_device` (chapter 05), which builds each tensor with `torch.tensor`, and
the step's own `sample_rows`. The steps come from real requests in the scheduler's state, one after another through
the same buffer (its reuse, its growth, the table entries a narrower step leaves behind); on CUDA the buffer is pinned
and the copy asynchronous.
"""

import random

import numpy as np
import pytest
import torch

from minirt.fast.staging import InputStaging, prepare_step
from minirt.model_runner import ModelRunner, StepInputs, pad_block_tables
from minirt.request import Request
from minirt.sampling import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_step(rng: random.Random, block_size: int, num_seqs: int, max_len: int, finish: bool | None = None
                ) -> StepInputs:
    """`random_items`' batch through the reference's `prepare_lists`."""
    runner = ModelRunner.__new__(ModelRunner)        # prepare_lists needs only the block size
    runner.block_size = block_size
    return runner.prepare_lists(random_items(rng, block_size, num_seqs, max_len, finish))


def random_items(rng: random.Random, block_size: int, num_seqs: int, max_len: int, finish: bool | None = None,
                 ahead: int = 0) -> list:
    """A batch of decodes and prefill chunks of random requests, as `(request, num_new_tokens)` (block tables from a
    shuffled pool, up to `ahead` more blocks than the request's tokens need, as bursts allocate them). A chunk that
    does not reach the end of its prompt is not sampled: finish=None mixes both, False makes every row such a chunk
    (no row to sample)."""
    pool = list(range(4 * num_seqs * (max_len // block_size + 1)))
    rng.shuffle(pool)
    items = []
    for _ in range(num_seqs):
        length = rng.randint(2 if finish is False else 1, max_len)
        request = Request(f"r{len(items)}", None, list(range(1, length + 1)), SamplingParams(max_new_tokens=4),
                          frozenset())
        request.num_computed_tokens = rng.choice([length - 1, rng.randint(0, length - 1)])
        left = length - request.num_computed_tokens
        if finish is False:
            request.num_computed_tokens = rng.randint(0, length - 2)
            left = rng.randint(1, length - 1 - request.num_computed_tokens)
        elif finish is None and rng.random() < 0.4:
            left = rng.randint(1, left)                          # a chunk that may stop short of the prompt's end
        request.block_table = [pool.pop() for _ in range(-(-length // block_size) + rng.randint(0, ahead))]
        items.append((request, left))
    return items


def test_prepare_step_equals_the_reference_prepare_lists():
    """`prepare_step` (numpy) against the reference's `prepare_lists` (a Python loop over the tokens, chapter 05) on
    random batches: every field equal, the block tables as `pad_block_tables` pads them to the longest context's
    blocks; block sizes 1 to 16, tables longer than the context (blocks allocated ahead), one-row batches."""
    rng = random.Random(11)
    for case in range(300):
        block_size = rng.choice([1, 2, 4, 16])
        items = random_items(rng, block_size, rng.randint(1, 12), rng.randint(2, 90), rng.choice([None, False]),
                             ahead=rng.choice([0, 3]))
        reference = ModelRunner.__new__(ModelRunner)
        reference.block_size = block_size
        want, got = reference.prepare_lists(items), prepare_step(items, block_size)
        for name in ("input_ids", "positions", "slots", "query_start_loc", "context_lens", "sample_rows"):
            assert list(getattr(got, name)) == getattr(want, name), (case, name)
        assert got.sample_requests == want.sample_requests and got.max_query_len == want.max_query_len, case
        width = -(-max(want.context_lens) // block_size)
        assert got.block_tables.tolist() == pad_block_tables(want.block_tables, width), case
        assert all(isinstance(getattr(got, name), np.ndarray) for name in ("input_ids", "positions", "slots")), case
    request = items[-1][0]
    request.block_table = request.block_table[:(request.num_computed_tokens + items[-1][1] - 1) // block_size]
    with pytest.raises(IndexError):                   # the reference's lookup past the table
        reference.prepare_lists(items)
    with pytest.raises(ValueError, match=rf"^block_table: .* request {request.request_id}'s context"):
        prepare_step(items, block_size)


@pytest.mark.parametrize("prepared", ["prepare_lists", "prepare_step"])
@pytest.mark.parametrize("device", DEVICES)
def test_send_equals_the_reference_to_device(device, prepared):
    rng = random.Random(5)
    block_size = 4
    reference = ModelRunner.__new__(ModelRunner)
    reference.block_size, reference.device = block_size, torch.device(device)
    staging = InputStaging(torch.device(device), block_size)
    grew = []
    # wide steps, then narrow ones (stale table entries to clear), a larger one (the buffer grows), one with no row
    # to sample; rows that are sampled and rows that are not
    sampled = []
    for num_seqs, max_len, finish in [(6, 60, None), (3, 9, None), (1, 2, None), (5, 40, None), (12, 200, None),
                                      (4, 30, False), (2, 5, None), (9, 50, None)]:
        items = random_items(rng, block_size, num_seqs, max_len, finish, ahead=2)
        step = reference.prepare_lists(items)
        sampled.append(len(step.sample_rows))
        ids, positions, meta, rows = staging.send(step if prepared == "prepare_lists" else prepare_step(items, 4))
        grew.append(staging.host.numel())
        want_ids, want_positions, want = reference.to_device(step)
        assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)
        for name in ("slot_mapping", "query_start_loc", "context_lens", "block_tables"):
            assert torch.equal(getattr(meta, name), getattr(want, name)), name
        assert (meta.max_query_len, meta.max_context_len) == (want.max_query_len, want.max_context_len)
        assert rows.tolist() == step.sample_rows and rows.device.type == device
        # 16-byte aligned, as a fresh tensor is: Triton compiles a kernel again for a pointer that is not
        views = [ids, positions, rows] + [getattr(meta, name) for name in ("slot_mapping", "query_start_loc",
                                                                           "context_lens", "block_tables")]
        assert all(t.data_ptr() % 16 == 0 for t in views), [t.data_ptr() % 16 for t in views]
    assert grew[4] > grew[0]                          # the 12-sequence step needed a larger buffer
    assert sampled[5] == 0 and any(0 < n < size for n, size in zip(sampled, [6, 3, 1, 5, 12, 4, 2, 9])), sampled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned buffer and its asynchronous copy need CUDA")
def test_the_next_send_waits_for_the_copy_before_it():
    """The copy of one step is queued behind a long kernel; the next step's send must not rewrite the pinned buffer
    before that copy has read it (the event `send` records after each copy). The first step's tensors, cloned on the
    device after its copy, must hold its own inputs, not the second step's."""
    rng = random.Random(7)
    staging = InputStaging(torch.device("cuda"), 4)
    reference = ModelRunner.__new__(ModelRunner)
    reference.block_size, reference.device = 4, torch.device("cuda")
    first, second = random_step(rng, 4, 5, 40), random_step(rng, 4, 5, 40)
    staging.send(second)                              # the buffer is large enough: no reallocation below
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                    # ~0.1 s of GPU time ahead of the first copy
    ids, _, meta, _ = staging.send(first)
    kept = (ids.clone(), meta.block_tables.clone())   # queued after the first copy, before the second
    staging.send(second)
    want_ids, _, want = reference.to_device(first)
    assert torch.equal(kept[0], want_ids) and torch.equal(kept[1], want.block_tables)
