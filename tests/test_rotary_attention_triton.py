"""`rotary_decode_attention_triton` (the q/k norm, the rotation and the K/V write in the decode attention kernel)
against independent oracles: the new token's q and k normalized and rotated by `minirt.fast.ops.norm_and_rotate` in
float64, then `torch.nn.functional.scaled_dot_product_attention` over each sequence's contiguous keys (the cached
ones and the new one); the cache slot of each new token against that rotated key and the value. Kernel cases need
CUDA or Triton's interpreter (`TRITON_INTERPRET=1`, the CPU runs float32 only)."""

from __future__ import annotations

import pytest
import torch

from conftest import TRITON_DEVICE
from minirt.fast.ops import norm_and_rotate
from test_paged_attention import build_case, oracle

INTERPRETER = TRITON_DEVICE == "cpu"
needs_kernel = pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")


def decode_case(seed, num_heads, num_kv_heads, head_dim, rot, norm, dtype, device, ctx_range=(1, 90), num_seqs=3,
                block_size=16):
    """A batch of decodes: each sequence's earlier keys in a shuffled paged cache, its new token's q/k/v as slices of
    one projection output (strided tokens, as the engine passes them), random cos/sin and norm weights. Returns
    the kernel's arguments and the oracle's output and the rotated new keys."""
    _, k_cache, v_cache, meta, ks, vs, _ = build_case(seed, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                                      device, num_seqs=num_seqs, ctx_range=ctx_range,
                                                      lens=None)
    n = len(ks)
    ctx = meta.context_lens.tolist()
    meta.query_start_loc, meta.max_query_len = torch.arange(n + 1, device=device), 1
    slots = [meta.block_tables[i, (c - 1) // block_size].item() * block_size + (c - 1) % block_size
             for i, c in enumerate(ctx)]
    meta.slot_mapping = torch.tensor(slots, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = (2 * torch.randn(1, n, sum(sizes), generator=gen)).to(dtype).to(device)
    q, k, v = qkv.split(sizes, dim=-1)
    q, k, v = (x.view(1, n, -1, head_dim) for x in (q, k, v))
    angles = torch.rand(1, n, rot // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
    qw, kw = ((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2))
    weights = (qw, kw, 1e-6) if norm else (None, None, 0.0)
    q_rot, k_rot = norm_and_rotate(q.double(), k.double(), cos.double(), sin.double(),
                                   *(w.double() if isinstance(w, torch.Tensor) else w for w in weights))
    q_rot, k_rot = q_rot.to(dtype), k_rot.to(dtype)       # the rotated q and k as the model would store them
    keys = [torch.cat([ks[i][:-1], k_rot[0, i:i + 1]]) for i in range(n)]
    values = [torch.cat([vs[i][:-1], v[0, i:i + 1]]) for i in range(n)]
    want = oracle(keys, values, [q_rot[0, i:i + 1] for i in range(n)])
    return (q, k, v, cos, sin, *weights, k_cache, v_cache, meta), want, k_rot[0], v[0], slots


def check(args, want, k_rot, v_new, slots, dtype, **options):
    from minirt.kernels.rotary_attention_triton import rotary_decode_attention_triton

    q, k, v, cos, sin, qw, kw, eps, k_cache, v_cache, meta = args
    got = rotary_decode_attention_triton(q, k, v, cos, sin, qw, kw, eps, k_cache, v_cache, meta, **options)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].float(), want, atol=tol, rtol=tol)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    torch.testing.assert_close(flat_k[slots].float(), k_rot.float(), atol=tol, rtol=tol)
    assert torch.equal(flat_v[slots], v_new)


@needs_kernel
@pytest.mark.parametrize("num_splits", [None, 1, 2, 16])
@pytest.mark.parametrize("shape", [(16, 8, 128, 128, True), (4, 2, 32, 32, True), (6, 2, 32, 16, False),
                                   (4, 4, 64, 48, True)], ids=str)       # (H, Hkv, D, rotary dim, q/k norm)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_decode_attention_matches_the_oracle(num_splits, shape, dtype):
    if INTERPRETER and dtype != torch.float32:
        pytest.skip("bfloat16 is checked on CUDA")
    num_heads, num_kv_heads, head_dim, rot, norm = shape
    args, want, k_rot, v_new, slots = decode_case(7 + head_dim, num_heads, num_kv_heads, head_dim, rot, norm, dtype,
                                                  TRITON_DEVICE)
    check(args, want, k_rot, v_new, slots, dtype, num_splits=num_splits)


@needs_kernel
@pytest.mark.parametrize("prefetch_kv", [True, False], ids=["prefetch", "wait-first"])
@pytest.mark.parametrize("num_splits", [1, 2], ids=["one-split", "two-splits"])
def test_new_key_in_a_later_tile_of_a_long_share(prefetch_kv, num_splits):
    """Contexts of 130-300 keys: a share spans 2 to 5 tiles, so the new key lies in the loop after the first
    (prefetched) tile, which must take it from the registers and the earlier keys from the cache."""
    args, want, k_rot, v_new, slots = decode_case(11, 6, 2, 32, 32, True, torch.float32, TRITON_DEVICE,
                                                  ctx_range=(130, 300))
    assert all(c > 64 * num_splits for c in args[-1].context_lens.tolist())
    check(args, want, k_rot, v_new, slots, torch.float32, num_splits=num_splits, prefetch_kv=prefetch_kv)


@needs_kernel
def test_split_combine_in_the_kernel(monkeypatch):
    """With split_counters the last split combines (`_last_split_combines`); the combine kernel never launches, and
    the counters are left zeroed for the next call."""
    from minirt.kernels import rotary_attention_triton as module
    from minirt.kernels.paged_attention_triton import split_counters_for

    monkeypatch.setattr(module, "_combine_splits_kernel", None)
    args, want, k_rot, v_new, slots = decode_case(13, 16, 8, 128, 128, True, torch.float32, TRITON_DEVICE)
    counters = split_counters_for(3, 8, torch.device(TRITON_DEVICE))
    for _ in range(2):
        check(args, want, k_rot, v_new, slots, torch.float32, num_splits=4, split_counters=counters)
        assert not counters.any()


def test_refuses_a_batch_with_prefill_chunks_by_name():
    pytest.importorskip("triton")
    from minirt.kernels.rotary_attention_triton import rotary_decode_attention_triton

    args, *_ = decode_case(3, 4, 2, 16, 16, True, torch.float32, "cpu")
    meta = args[-1]
    meta.max_query_len = 2
    with pytest.raises(ValueError, match=r"^meta: must be a batch of decodes, one token per sequence "
                                         r"\(max_query_len 1, 3 sequences\), got max_query_len 2, 3 sequences$"):
        rotary_decode_attention_triton(*args)
