"""The fast runner's one-copy inputs (minirt.fast.staging.InputStaging) against the reference runner's `to_device`.

Oracle: `minirt.model_runner.ModelRunner.to_device` (chapter 05), which builds each tensor with `torch.tensor`, and
the step's own `sample_rows`. The steps come from real requests in the scheduler's state, one after another through
the same buffer (its reuse, its growth, the table entries a narrower step leaves behind); on CUDA the buffer is pinned
and the copy asynchronous.
"""

import random

import pytest
import torch

from minirt.fast.staging import InputStaging
from minirt.model_runner import ModelRunner, StepInputs
from minirt.request import Request
from minirt.sampling import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_step(rng: random.Random, block_size: int, num_seqs: int, max_len: int) -> StepInputs:
    """A packed batch of decodes and prefill chunks of random requests (block tables from a shuffled pool)."""
    pool = list(range(4 * num_seqs * (max_len // block_size + 1)))
    rng.shuffle(pool)
    items = []
    for _ in range(num_seqs):
        length = rng.randint(1, max_len)
        request = Request(f"r{len(items)}", None, list(range(1, length + 1)), SamplingParams(max_new_tokens=4),
                          frozenset())
        request.num_computed_tokens = rng.choice([length - 1, rng.randint(0, length - 1)])
        request.block_table = [pool.pop() for _ in range(-(-length // block_size))]
        items.append((request, length - request.num_computed_tokens))
    runner = ModelRunner.__new__(ModelRunner)        # prepare_lists needs only the block size
    runner.block_size = block_size
    return runner.prepare_lists(items)


@pytest.mark.parametrize("device", DEVICES)
def test_send_equals_the_reference_to_device(device):
    rng = random.Random(5)
    block_size = 4
    reference = ModelRunner.__new__(ModelRunner)
    reference.block_size, reference.device = block_size, torch.device(device)
    staging = InputStaging(torch.device(device), block_size)
    grew = []
    # wide steps, then narrow ones (stale table entries to clear), then a larger one (the buffer grows)
    for num_seqs, max_len in [(6, 60), (3, 9), (1, 2), (5, 40), (12, 200), (2, 5)]:
        step = random_step(rng, block_size, num_seqs, max_len)
        ids, positions, meta, rows = staging.send(step)
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
