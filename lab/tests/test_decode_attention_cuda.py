"""`decode_attention_cuda` (a decode step's q/k norm, rotation, K/V write, split-KV attention and combine in one CUDA
kernel, thread block clusters combining the splits) against oracles: `minirt.fast.ops.norm_rotate_and_store` in
float64 for the rotated key in its cache slot, then `minirt.attention.paged_attention_reference` in float64 over
that cache for the output. Kernel cases need a Hopper GPU and nvcc (skipped elsewhere); the argument checks run on
any machine (they come before the check for the GPU)."""

from __future__ import annotations

import pytest
import torch

from slow_copy import slow_copy

from minirt.attention import PagedAttentionMetadata, paged_attention_reference
from minirt.fast.ops import norm_rotate_and_store
from lab.kernels.decode_attention_cuda import decode_attention_cuda, decode_attention_missing

CUDA = torch.device("cuda")
MISSING = decode_attention_missing(CUDA, torch.bfloat16, 128, 2, 128) if torch.cuda.is_available() else ["CUDA"]
needs_kernel = pytest.mark.skipif(bool(MISSING), reason=f"needs {MISSING}")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_step(num_seqs, H, Hkv, D, context_lens, dtype, device, block_size=16, norm=True, seed=0, scale=1.0):
    """A decode step: caches full of earlier keys and values, each sequence's blocks scattered, q/k/v as slices of
    one projection (strided tokens), cos/sin of each new position. Returns the kernel's arguments as a dict."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max(blocks_per_seq) + 1, dtype=torch.int64)
    at = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[at:at + n]
        at += n
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    pos = ctx - 1
    slots = tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    sizes = [H * D, Hkv * D, Hkv * D]
    qkv = (scale * torch.randn(1, num_seqs, sum(sizes), generator=gen)).to(dtype)
    q, k, v = qkv.split(sizes, dim=-1)
    angles = pos[:, None].double() * (1e4 ** (-torch.arange(0, D, 2).double() / D))
    cos = torch.cat([angles.cos()] * 2, -1)[None].to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1)[None].to(dtype)
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=gen)).to(dtype) for _ in range(2))
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q.view(1, num_seqs, H, D)), k=to(k.view(1, num_seqs, Hkv, D)), v=to(v.view(1, num_seqs, Hkv, D)),
                cos=to(cos), sin=to(sin), q_weight=to(qw) if norm else None, k_weight=to(kw) if norm else None,
                eps=1e-6, k_cache=to(k_cache), v_cache=to(v_cache), slot_mapping=to(slots), block_tables=to(tables),
                context_lens=to(ctx))


def oracle(step):
    """float64: the rotated q, the caches after the write, and attention over them."""
    a = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in step.items()}
    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    q = norm_rotate_and_store(a["q"], a["k"], a["v"], a["cos"], a["sin"], a["q_weight"], a["k_weight"], a["eps"],
                              k_cache, v_cache, a["slot_mapping"])
    T = q.shape[1]
    meta = PagedAttentionMetadata(slot_mapping=a["slot_mapping"], query_start_loc=torch.arange(T + 1, device=q.device),
                                  context_lens=a["context_lens"], block_tables=a["block_tables"], max_query_len=1,
                                  max_context_len=int(a["context_lens"].max()))
    return paged_attention_reference(q[0], k_cache, v_cache, meta)[None], k_cache, v_cache


CASES = [  # (num_seqs, H, Hkv, D, context lengths, splits)
    (1, 16, 8, 128, [640], None),          # Qwen3-0.6B at batch 1: 16 blocks per cluster, one tile each
    (1, 16, 8, 128, [1], None),            # the first decode: one key, 15 empty shares
    (1, 16, 8, 128, [2500], 16),           # shares of 192 keys: three tiles, the last one partial
    (3, 8, 4, 64, [17, 300, 64], 4),
    (2, 4, 2, 32, [33, 129], None),        # the tiny Qwen3 of the equality tests
    (5, 4, 2, 16, [5, 16, 31, 200, 1], 8),  # the tiny Llama's
    (2, 8, 8, 128, [90, 700], 2),          # one query head per KV head
    (1, 32, 4, 128, [513], 16),            # eight
    (2, 32, 4, 128, [300, 40], 4),         # ... at the fewest blocks a cluster (min_splits): 256 outputs each
    (1, 16, 4, 128, [200], 2),             # four, at two blocks: 256 outputs each
    (4, 16, 4, 64, [64, 65, 128, 1000], 1),  # no split: a cluster of one block walks every tile
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_attention_matches_rotation_write_and_attention(case, norm, dtype):
    num_seqs, H, Hkv, D, context_lens, splits = case
    step = make_step(num_seqs, H, Hkv, D, context_lens, dtype, CUDA, norm=norm)
    want, k_cache, v_cache = oracle(step)
    got = decode_attention_cuda(**step, num_splits=splits)
    assert got.shape == step["q"].shape and got.dtype == dtype and got.is_contiguous()
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    slots = step["slot_mapping"]
    flat = lambda c: c.flatten(0, 1)  # noqa: E731
    torch.testing.assert_close(flat(step["k_cache"])[slots].double(), flat(k_cache)[slots], atol=tol * 8, rtol=tol)
    assert torch.equal(flat(step["v_cache"])[slots].double(), flat(v_cache)[slots])       # v is copied
    untouched = torch.ones(flat(k_cache).shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):                      # no other slot
        assert torch.equal(flat(step[name])[untouched].double(), flat(cache)[untouched])


def _qkv_views(step, qkv, H, Hkv, D):
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    T = qkv.shape[1]
    step.update(q=q.view(1, T, H, D), k=k.view(1, T, Hkv, D), v=v.view(1, T, Hkv, D))


@needs_kernel
def test_pdl_decode_attention_reads_qkv_after_the_kernel_before():
    """With PDL the kernel starts while the kernel before it runs and loads earlier steps' keys and values before it
    waits; q, k and v it must load after. Here the kernel before spins for 1 ms before it writes them, and until
    then the buffer holds values that put the output far from the oracle (checked first, so the test can fail)."""
    from minirt.kernels import pdl_missing

    if missing := pdl_missing(CUDA):
        pytest.skip(f"PDL needs {missing}")
    step = make_step(2, 16, 8, 128, [700, 90], torch.bfloat16, CUDA)
    fresh = torch.cat([step[n].flatten(2) for n in ("q", "k", "v")], dim=-1)           # [1, T, (H + 2 Hkv) D]
    qkv = torch.empty_like(fresh)
    _qkv_views(step, qkv, 16, 8, 128)
    caches = step["k_cache"].clone(), step["v_cache"].clone()
    qkv.copy_(fresh)
    want, k_want, v_want = oracle(step)
    qkv.copy_(-4 * fresh)                                    # stale: q negated and scaled, k and v too
    assert (decode_attention_cuda(**step).double() - want).abs().max() > 0.5
    step["k_cache"].copy_(caches[0])
    step["v_cache"].copy_(caches[1])
    slow_copy(fresh, qkv)
    got = decode_attention_cuda(**step, pdl=True)
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    torch.testing.assert_close(step["k_cache"].double(), k_want, atol=0.2, rtol=2e-2)
    assert torch.equal(step["v_cache"].double(), v_want)


@needs_kernel
@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
def test_decode_attention_in_a_cuda_graph(pdl):
    """Captured in a CUDA graph behind a kernel that writes q/k/v: every replay reads that replay's q/k/v and writes
    its new key and value."""
    step = make_step(1, 16, 8, 128, [700], torch.bfloat16, CUDA)
    source = torch.randn(1, 1, 16 * 128 + 2 * 8 * 128, device=CUDA).to(torch.bfloat16)
    qkv = torch.empty_like(source)
    _qkv_views(step, qkv, 16, 8, 128)
    caches = step["k_cache"].clone(), step["v_cache"].clone()

    def run():
        qkv.copy_(source * 1.5)
        return decode_attention_cuda(**step, pdl=pdl)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for scale in (1.0, -2.0, 0.5):
        source.mul_(scale)
        step["k_cache"].copy_(caches[0])
        step["v_cache"].copy_(caches[1])
        graph.replay()
        want, k_want, v_want = oracle({**step, "k_cache": caches[0], "v_cache": caches[1]})
        torch.testing.assert_close(out.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
        torch.testing.assert_close(step["k_cache"].double(), k_want, atol=0.2, rtol=2e-2)
        assert torch.equal(step["v_cache"].double(), v_want)


def test_decode_attention_refuses_what_it_cannot_run():
    """On any machine: shapes, layouts and the split count are checked before the machine is, each error naming its
    argument; then what this machine or model lacks, named."""
    step = make_step(2, 32, 4, 128, [5, 9], torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^q: the CUDA decode attention cannot run here: needs a CUDA device"):
        decode_attention_cuda(**step)
    cases = [({"q": step["q"][:, :1]}, r"^q: must be \[1, num_seqs, H, D\] with one token per sequence \(2\)"),
             ({"k": step["k"].double()}, r"^k: must be torch.float32 \[1, 2, 4, 128\]"),
             ({"sin": step["sin"][..., :64]}, r"^sin: must be torch.float32 \[1, 2, 128\]"),
             ({"k_weight": None}, r"^q_weight/k_weight: give both or neither"),
             ({"v_cache": step["v_cache"][..., :64]},
              r"^v_cache: must be torch.float32 \[num_blocks, block_size, 4, 128\]"),
             ({"slot_mapping": step["slot_mapping"].int()}, r"^slot_mapping: must be int64 \[2\]"),
             ({"num_splits": 2}, r"^num_splits: must be a power of two from 4 \(this query group's outputs"),
             ({"num_splits": 32}, r"^num_splits: must be a power of two from 4 .* to 16, got 32"),
             ({"num_splits": 6}, r"^num_splits: must be a power of two")]
    for change, words in cases:
        with pytest.raises(ValueError, match=words):
            decode_attention_cuda(**{**step, **change})
    missing = decode_attention_missing(torch.device("cpu"), torch.float16, 96, 3, 48)
    assert missing[0].startswith("a CUDA device") and len(missing) == 5


@pytest.mark.parametrize("capability,nvcc,want", [
    ((9, 0), "/usr/bin/nvcc", []),
    ((10, 0), "/usr/bin/nvcc", []),
    ((8, 0), "/usr/bin/nvcc", ["compute capability 9.0 or later (got 8.0)"]),
    ((9, 0), None, ["nvcc (CUDA_HOME or on the PATH) to build the kernel"])])
def test_what_a_hopper_kernel_built_here_needs(monkeypatch, capability, nvcc, want):
    """`hopper_nvcc_missing` on a CUDA device of each capability, with and without nvcc (faked: any machine)."""
    from lab.kernels import nvcc_build

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(nvcc_build, "nvcc", lambda: nvcc)
    assert nvcc_build.hopper_nvcc_missing(torch.device("cuda", 0)) == want
    assert nvcc_build.hopper_nvcc_missing(torch.device("cpu")) == ["a CUDA device (got cpu)"]
