"""Paged attention (the torch reference and, on CUDA, the Triton kernel) against an independent oracle:
`torch.nn.functional.scaled_dot_product_attention` over each sequence's contiguous K/V with a causal mask."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import TRITON_DEVICE
from minirt.attention import PagedAttentionMetadata, paged_attention_reference, store_kv

CUDA = torch.cuda.is_available()
INTERPRETER = TRITON_DEVICE == "cpu"         # the Triton kernels on CPU tensors, through Triton's interpreter


def build_case(seed, block_size, num_heads, num_kv_heads, head_dim, dtype, device, num_seqs=6, ctx_range=(1, 90),
               lens=None):
    """Random sequences, each with a cached prefix and some new tokens, scattered over a shuffled pool.
    lens: (context, new tokens) of each sequence, in place of random ones."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [rng.randint(*ctx_range) for _ in range(num_seqs)]
    q_lens = [rng.choice([1, 1, rng.randint(1, c)]) for c in ctx_lens]      # decodes and prefill chunks
    if lens is not None:
        ctx_lens, q_lens = [c for c, _ in lens], [ql for _, ql in lens]
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables, ks, vs, qs, slots = [], [], [], [], []
    for c, ql in zip(ctx_lens, q_lens):
        table = [free.pop() for _ in range(-(-c // block_size))]
        tables.append(table)
        k = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=gen).to(dtype).to(device))
        s = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)], device=device)
        store_kv(k_cache, v_cache, k, v, s)               # the whole context, cached prefix and new tokens
        slots.append(s[c - ql:])
    width = max(len(t) for t in tables)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), device=device),
        context_lens=torch.tensor(ctx_lens, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        max_query_len=max(q_lens), max_context_len=max(ctx_lens))
    return torch.cat(qs), k_cache, v_cache, meta, ks, vs, qs


def oracle(ks, vs, qs):
    """SDPA per sequence on contiguous K/V; query i of a sequence with context c sits at c - q_len + i."""
    outs = []
    for k, v, q in zip(ks, vs, qs):
        c, ql = k.shape[0], q.shape[0]
        allowed = torch.arange(c, device=q.device)[None, :] <= (c - ql + torch.arange(ql, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), attn_mask=allowed,
                                           enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


KERNELS = [pytest.param(paged_attention_reference, "cpu", id="torch-cpu")]
if CUDA:
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    KERNELS += [pytest.param(paged_attention_reference, "cuda", id="torch-cuda"),
                pytest.param(paged_attention_triton, "cuda", id="triton-cuda")]
if INTERPRETER:
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    KERNELS += [pytest.param(paged_attention_triton, "cpu", id="triton-interpreter")]


SHAPES = [(4, 4, 16), (4, 2, 32), (8, 2, 64), (16, 8, 128), (6, 2, 32)]
# bf16 on the CPU only for the small shapes: slow, and the float32 cases already check the logic there.
CASES = [pytest.param(kernel, device, bs, *shape, dtype, id=f"{kid}-B{bs}-{shape}-{str(dtype)[6:]}")
         for kernel, device, kid in ((p.values[0], p.values[1], p.id) for p in KERNELS)
         for bs in (1, 4, 16) for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)
         if not (device == "cpu" and dtype == torch.bfloat16 and shape[2] > 32)
         if not (kid == "triton-interpreter" and dtype != torch.float32)]     # bf16: the CUDA runs check it


@pytest.mark.parametrize("kernel,device,block_size,num_heads,num_kv_heads,head_dim,dtype", CASES)
def test_paged_attention_matches_sdpa(kernel, device, block_size, num_heads, num_kv_heads, head_dim, dtype):
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(block_size * 100 + head_dim, block_size, num_heads,
                                                       num_kv_heads, head_dim, dtype, device)
    got = kernel(q, k_cache, v_cache, meta).float()
    want = oracle(ks, vs, qs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_kv_matches_sdpa(decode_only, num_splits, dtype):
    """Split-KV (several programs share a sequence's keys, a second kernel combines them) against the oracle."""
    from minirt.kernels.paged_attention_triton import choose_num_splits, paged_attention_triton

    if INTERPRETER and dtype != torch.float32:
        pytest.skip("bfloat16 is checked on CUDA")
    device = TRITON_DEVICE
    seed = 31 + (num_splits or 0)
    while True:                          # three sequences: the "mixed" case needs at least one prefill chunk
        q, k_cache, v_cache, meta, ks, vs, qs = build_case(seed, 16, 16, 8, 128, dtype, device, num_seqs=3)
        if decode_only or meta.max_query_len > 1:
            break
        seed += 100
    if decode_only:                      # keep each sequence's last query: a batch of decodes
        qs = [x[-1:] for x in qs]
        n = len(qs)
        q = torch.cat(qs)
        meta.query_start_loc, meta.max_query_len = torch.arange(n + 1, device=device), 1
        meta.slot_mapping = meta.slot_mapping[:n]
        if CUDA:
            assert choose_num_splits(meta, 8, q.device) > 1   # 3 x 8 programs leave most SMs idle
    else:
        assert choose_num_splits(meta, 8, q.device) == 1      # prefill chunks: never split by default
    got = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=num_splits).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, oracle(ks, vs, qs), atol=tol, rtol=tol)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
@pytest.mark.parametrize("prefetch_kv", [True, False], ids=["prefetch", "wait-first"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["group1", "group3", "group4"])
def test_split_kv_with_several_tiles_per_split_matches_sdpa(decode_only, prefetch_kv, num_heads, num_kv_heads):
    """Two splits over 130-300 keys: each split's share is 2 to 3 tiles of 64 keys, so the loop after the first
    (peeled, prefetched) tile runs too, with GQA groups of 1, 3 and 4 query heads per KV head (a loop that
    started at the first tile again would count it twice; one that skipped the rest would miss keys)."""
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    device = TRITON_DEVICE
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(5, 16, num_heads, num_kv_heads, 32, torch.float32, device,
                                                       num_seqs=3, ctx_range=(130, 300))
    if decode_only:
        qs = [x[-1:] for x in qs]
        q = torch.cat(qs)
        meta.query_start_loc, meta.max_query_len = torch.arange(len(qs) + 1, device=device), 1
    assert all(-(-k.shape[0] // 2) > 64 for k in ks)                # every split's share is more than one tile
    got = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=2, prefetch_kv=prefetch_kv).float()
    torch.testing.assert_close(got, oracle(ks, vs, qs), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("num_heads,num_kv_heads,chunk_block_m,chunk_tile", [
    pytest.param(4, 2, None, None, id="group2"), pytest.param(4, 4, None, None, id="group1"),
    pytest.param(6, 2, None, None, id="group3"), pytest.param(6, 2, 64, (32, 4, 2), id="group3-64-rows-32-keys"),
    pytest.param(4, 2, None, (128, 8, 2), id="group2-128-keys")])
def test_prefill_chunks_after_long_prefixes_match_sdpa(num_heads, num_kv_heads, chunk_block_m, chunk_tile):
    """The chunk launch splits each query tile's key loop: whole key tiles before the tile's first position, which
    all its rows see, without a mask, then the rest with the causal mask. Chunks of up to 300 tokens after cached
    prefixes of 0 to 177 keys (block size 16) give query tiles with several unmasked key tiles, diagonals on and off
    the key tiles' boundaries and last query tiles partly filled (with GQA groups of 3, rows past the last whole
    token too); two decodes share the step. Each tiling of the chunk launch against the oracle."""
    from minirt.kernels.paged_attention_triton import CHUNK_BLOCK_M, CHUNK_TILE, paged_attention_triton

    lens = [(337, 300), (171, 171), (90, 1), (250, 1), (200, 23)]    # (context, new tokens)
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(9, 16, num_heads, num_kv_heads, 16, torch.float32,
                                                       TRITON_DEVICE, lens=lens)
    tokens = (chunk_block_m or CHUNK_BLOCK_M) // (num_heads // num_kv_heads)
    block_n = (chunk_tile or CHUNK_TILE)[0]
    firsts = [c - ql + t for c, ql in lens if ql > 1 for t in range(0, ql, tokens)]    # query tiles' first positions
    assert max(firsts) >= 2 * block_n and any(f % block_n for f in firsts) and any(f % block_n == 0 for f in firsts)
    got = paged_attention_triton(q, k_cache, v_cache, meta, chunk_tile=chunk_tile, chunk_block_m=chunk_block_m)
    torch.testing.assert_close(got.float(), oracle(ks, vs, qs), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
@pytest.mark.parametrize("num_splits,ctx_range", [(2, (1, 90)), (16, (1, 90)), (16, (600, 1100))],
                         ids=["2-splits", "16-splits", "16-splits-long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_combine_in_attention_matches_sdpa(decode_only, num_splits, ctx_range, dtype, monkeypatch):
    """Chapter 07's `combine_in_attention`: with `split_counters` the last split of each (sequence, KV head, query
    tile) to finish combines the splits' results in the attention kernel, and the combine kernel is never launched.
    Against the oracle, as the two-kernel path is (long contexts: every one of the 16 splits has keys); run twice
    on one counter buffer, which the kernel leaves zeroed."""
    from minirt.kernels import paged_attention_triton as module
    from minirt.kernels.paged_attention_triton import paged_attention_triton, split_counters_for

    if INTERPRETER and dtype != torch.float32:
        pytest.skip("bfloat16 is checked on CUDA")
    if INTERPRETER and not decode_only and ctx_range[0] > 90:
        pytest.skip("prefill chunks of up to 1,100 tokens take minutes in the interpreter; CUDA runs this case")
    monkeypatch.setattr(module, "_combine_splits_kernel", None)       # launching it would raise TypeError
    device = TRITON_DEVICE
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(71 + num_splits, 16, 16, 8, 128, dtype, device, num_seqs=3,
                                                       ctx_range=ctx_range)
    if decode_only:
        qs = [x[-1:] for x in qs]
        q = torch.cat(qs)
        meta.query_start_loc, meta.max_query_len = torch.arange(4, device=device), 1
    else:
        assert meta.max_query_len > 1
    tiles = -(-meta.max_query_len // 8)                            # 16 query rows per tile: 8 tokens x 2 heads
    counters = split_counters_for(3 * tiles, 8, torch.device(device))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        got = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=num_splits, split_counters=counters)
        torch.testing.assert_close(got.float(), oracle(ks, vs, qs), atol=tol, rtol=tol)
        assert not counters.any()


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
def test_each_group_of_splits_counts_on_its_own_counter():
    """The counters are the combine's only synchronization, so each (sequence, KV head, query tile) must have its
    own and the combine must fire at the last ticket. The counter of sequence 0, KV head 0, tile 0 starts at 1
    instead of 0: that group combines one split early (its rows are not checked); every other counter ends at 0
    and every other group's rows match the oracle. Every row has keys in both splits, so a group that shared the
    first one's counter (the next tile, or the next sequence) would combine early too and come out wrong. In the
    interpreter, which runs programs one after another, the first counter ends at exactly 1 (a combine on the
    wrong ticket would leave it elsewhere); on a GPU the second split may count itself in before or after the
    first one's reset, so it ends at 1 or 0."""
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    device = TRITON_DEVICE
    for seed in range(1000):
        q, k_cache, v_cache, meta, ks, vs, qs = build_case(seed, 16, 4, 2, 32, torch.float32, device, num_seqs=3,
                                                           ctx_range=(100, 140))
        q_lens = [x.shape[0] for x in qs]
        if 8 < q_lens[0] and meta.max_query_len <= 24 and all(k.shape[0] - ql >= 64 for k, ql in zip(ks, q_lens)):
            break                   # sequence 0 has two query tiles; every row sees more than the first split's 64 keys
    else:
        pytest.fail("no seed gave the case")
    tiles = 3                                               # 8 tokens x 2 query heads per tile of 16 rows
    counters = torch.zeros(3 * 2 * tiles, dtype=torch.int32, device=device)
    counters[0] = 1
    got = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=2, split_counters=counters).float()
    assert not counters[1:].any()
    assert counters[0].item() in ((1,) if INTERPRETER else (0, 1))
    early = torch.zeros(got.shape[:2], dtype=torch.bool, device=device)    # [num_tokens, H]: that group's rows
    early[:8, :2] = True                                                    # tokens 0-7 of sequence 0, heads 0-1
    torch.testing.assert_close(got[~early], oracle(ks, vs, qs)[~early], atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("q_len,num_splits,prefetch_kv,combine,num_heads,num_kv_heads", [
    pytest.param(3, 2, True, False, 4, 2, id="q3-2-splits"), pytest.param(9, 16, True, False, 4, 2, id="q9-16-splits"),
    pytest.param(9, 4, False, False, 4, 2, id="q9-wait-first"), pytest.param(9, 4, True, True, 4, 2, id="q9-combine"),
    pytest.param(5, 8, True, False, 6, 2, id="q5-group3"), pytest.param(5, 2, True, True, 6, 2, id="q5-group3-combine")])
def test_uniform_rows_with_split_kv_match_sdpa(q_len, num_splits, prefetch_kv, combine, num_heads, num_kv_heads):
    """A verification step as its CUDA graphs launch it (`minirt.fast.cuda_graphs.DecodeGraphs` with query length
    q_len, `minirt.fast.attention.verify_kernel`): every sequence has q_len new rows, split-KV on, with the K/V
    prefetch before the PDL wait or not, combined by the second kernel or in the attention kernel. Some sequences
    end with padding rows (a draft shorter than q_len - 1, none at all): the context length counts them and the keys
    at their positions hold garbage (large values a rejected draft or another request left); the real rows must
    match SDPA over the real context alone (q_len 9 with 8 tokens per query tile: two tiles per sequence)."""
    from minirt.kernels.paged_attention_triton import paged_attention_triton, split_counters_for

    device = TRITON_DEVICE
    real = [q_len, 1, q_len - 1, 2]                                  # real rows per sequence; the rest padding
    contexts = [37, 90, 64, 5]                                      # real context, real rows included
    lens = [(c + q_len - n, q_len) for c, n in zip(contexts, real)]
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(17 + q_len, 16, num_heads, num_kv_heads, 32, torch.float32,
                                                       device, lens=lens)
    gen = torch.Generator().manual_seed(5)
    for s, (c, n) in enumerate(zip(contexts, real)):                # garbage where the padding rows' keys are read
        table = meta.block_tables[s]
        slots = torch.stack([table[p // 16] * 16 + p % 16 for p in range(c, c + q_len - n)]) if n < q_len else None
        if slots is not None:
            garbage = 1e3 * torch.randn(len(slots), num_kv_heads, 32, generator=gen).to(device)
            store_kv(k_cache, v_cache, garbage, garbage.flip(0), slots)
    counters = split_counters_for(len(lens) * q_len, num_kv_heads, torch.device(device)) if combine else None
    got = paged_attention_triton(q, k_cache, v_cache, meta, num_splits=num_splits, prefetch_kv=prefetch_kv,
                                 split_counters=counters).float()
    rows = torch.cat([torch.arange(n) + s * q_len for s, n in enumerate(real)]).to(device)
    want = oracle([k[:c] for k, c in zip(ks, contexts)], [v[:c] for v, c in zip(vs, contexts)],
                  [x[:n] for x, n in zip(qs, real)])
    torch.testing.assert_close(got[rows], want, atol=2e-5, rtol=2e-5)
    assert counters is None or not counters.any()


def test_choose_num_splits_fills_twice_the_sms_up_to_max_splits(monkeypatch):
    """`choose_num_splits` on a (stand-in) 132-SM GPU against brute force: the smallest power of two of splits that
    gives the decode batch's (sequence, KV head) pairs at least two programs per SM, at most `MAX_SPLITS`; 1 for a
    step with a prefill chunk."""
    pytest.importorskip("triton")
    from minirt.kernels import paged_attention_triton as module

    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")                                 # a device object only: nothing runs on it
    for max_splits in (8, 16, 32):
        monkeypatch.setattr(module, "MAX_SPLITS", max_splits)
        for seqs in (1, 2, 3, 5, 8, 17, 33, 64):
            meta = PagedAttentionMetadata(
                slot_mapping=torch.zeros(seqs, dtype=torch.long), query_start_loc=torch.arange(seqs + 1),
                context_lens=torch.full((seqs,), 700), block_tables=torch.zeros(seqs, 44, dtype=torch.long),
                max_query_len=1, max_context_len=700)
            want = 1
            while want < max_splits and seqs * 8 * want < 2 * 132:
                want *= 2
            assert module.choose_num_splits(meta, 8, cuda) == want, (max_splits, seqs)
            meta.max_query_len = 2
            assert module.choose_num_splits(meta, 8, cuda) == 1


def test_split_counters_refused_when_they_cannot_serve():
    pytest.importorskip("triton")
    from minirt.kernels.paged_attention_triton import paged_attention_triton, split_counters_for

    q, k_cache, v_cache, meta, *_ = build_case(3, 16, 4, 2, 16, torch.float32, "cpu", num_seqs=3)
    meta.query_start_loc, meta.max_query_len = torch.arange(4), 1
    q = q[:3]
    for bad, words in ((split_counters_for(2, 2, torch.device("cpu")), "torch.int32, 4 elements"),
                       (torch.zeros(6, dtype=torch.int64), "torch.int64, 6 elements")):
        with pytest.raises(ValueError, match=rf"^split_counters: must be a contiguous int32 tensor on cpu with at "
                                             rf"least 6 elements \(sequences x KV heads x query tiles\), got {words}"):
            paged_attention_triton(q, k_cache, v_cache, meta, num_splits=2, split_counters=bad)


@pytest.mark.skipif(not CUDA, reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
def test_split_combine_in_attention_in_a_cuda_graph(pdl):
    """As a decode step uses it: the K/V write and attention with the in-kernel combine captured in one CUDA graph
    and replayed on new queries, K/V and a growing context; each replay matches the oracle and leaves the
    counters zeroed (a counter left at a count would make a later replay combine too early or never)."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.paged_attention_triton import paged_attention_triton, split_counters_for, store_kv_triton

    if pdl and (missing := pdl_missing(torch.device("cuda"))):
        pytest.skip(f"PDL needs {missing}")
    _, k_cache, v_cache, meta, ks, vs, _ = build_case(13, 16, 16, 8, 128, torch.bfloat16, "cuda", num_seqs=4)
    n = 4
    # Each sequence's blocks plus one block nobody uses, so that three more tokens always fit.
    used = {b for s in range(n) for b in meta.block_tables[s, :-(-ks[s].shape[0] // 16)].tolist()}
    spare = [b for b in range(k_cache.shape[0]) if b not in used][:n]
    table = torch.cat([meta.block_tables, torch.zeros(n, 1, dtype=torch.int64, device="cuda")], 1)
    for s in range(n):
        table[s, -(-ks[s].shape[0] // 16)] = spare[s]
    meta.block_tables = table
    meta.query_start_loc, meta.max_query_len = torch.arange(n + 1, device="cuda"), 1
    meta.max_context_len += 3
    q_in = torch.zeros(n, 16, 128, dtype=torch.bfloat16, device="cuda")
    k_in, v_in = (torch.zeros(n, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    meta.slot_mapping = torch.zeros(n, dtype=torch.int64, device="cuda")
    counters = split_counters_for(n, 8, torch.device("cuda"))

    def step():
        store_kv_triton(k_cache, v_cache, k_in, v_in, meta.slot_mapping, pdl=pdl)
        return paged_attention_triton(q_in, k_cache, v_cache, meta, num_splits=16, pdl=pdl, split_counters=counters)

    meta.context_lens.sub_(1)           # the warm-up and the capture rewrite each sequence's last key with zeros
    meta.slot_mapping.copy_(torch.stack([table[s, (ks[s].shape[0] - 1) // 16] * 16 + (ks[s].shape[0] - 1) % 16
                                         for s in range(n)]))
    meta.context_lens.add_(1)
    for s in range(n):
        ks[s][-1], vs[s][-1] = 0, 0
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):                  # each replay appends one token to every sequence
        pos = meta.context_lens.clone()
        meta.slot_mapping.copy_(table.gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16)
        meta.context_lens.add_(1)
        new = [torch.randn(n, h, 128, generator=gen).to(torch.bfloat16).cuda() for h in (16, 8, 8)]
        for dst, src in zip((q_in, k_in, v_in), new):
            dst.copy_(src)
        for s in range(n):
            ks[s], vs[s] = torch.cat([ks[s], new[1][s:s + 1]]), torch.cat([vs[s], new[2][s:s + 1]])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), oracle(ks, vs, [new[0][s:s + 1] for s in range(n)]),
                                   atol=2e-2, rtol=2e-2)
        assert not counters.any()


@pytest.mark.skipif(not CUDA, reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
def test_triton_kernels_with_pdl_equal_without(decode_only):
    """Programmatic dependent launch changes when a kernel may start, never what it computes: the K/V write,
    attention and the split-KV combine launched with PDL, one after another, give the same bits, with the K/V
    prefetch before the wait and without it."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(7, 16, 16, 8, 128, torch.bfloat16, "cuda", num_seqs=3)
    if decode_only:
        meta.query_start_loc, meta.max_query_len = torch.arange(4, device="cuda"), 1
        q = torch.cat([x[-1:] for x in qs])
    outs = []
    for pdl, prefetch_kv in ((False, False), (True, False), (True, True)):
        kc, vc = k_cache.clone(), v_cache.clone()
        torch.manual_seed(0)
        k_new, v_new = torch.randn_like(q[:, :8]), torch.randn_like(q[:, :8])
        store_kv_triton(kc, vc, k_new, v_new, meta.slot_mapping[:q.shape[0]], pdl=pdl)
        outs.append((paged_attention_triton(q, kc, vc, meta, pdl=pdl, prefetch_kv=prefetch_kv), kc, vc))
    torch.cuda.synchronize()
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


if CUDA:
    import triton
    import triton.language as tl
    from pdl_writer import spin_before_writing

    @triton.jit
    def _slow_store_kv(K, V, KCache, VCache, slot_mapping, stride_t, stride_slot, QSrc, Q, SPIN_NS: tl.constexpr,
                       ROW: tl.constexpr, Q_ROW: tl.constexpr):
        """`store_kv_triton`'s write, and the copy of each token's query row QSrc -> Q, after a SPIN_NS-nanosecond
        spin: a kernel before attention that is still running long after attention, launched with PDL, has
        started."""
        spin_before_writing(SPIN_NS)
        token = tl.program_id(0)
        slot = tl.load(slot_mapping + token).to(tl.int64)
        offs = tl.arange(0, ROW)
        tl.store(KCache + slot * stride_slot + offs, tl.load(K + token * stride_t + offs))
        tl.store(VCache + slot * stride_slot + offs, tl.load(V + token * stride_t + offs))
        q_offs = tl.arange(0, Q_ROW)
        tl.store(Q + token * Q_ROW + q_offs, tl.load(QSrc + token * Q_ROW + q_offs))


@pytest.mark.skipif(not CUDA, reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("prefetch_kv", [True, False], ids=["prefetch", "wait-first"])
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
def test_pdl_attention_loads_this_steps_keys_after_the_kernel_before(decode_only, prefetch_kv):
    """With PDL the attention kernel starts while the kernel before it runs, and loads earlier steps' keys and
    values before it waits for that kernel; this step's keys and values, and q, it must load after. Here the
    kernel before spins for 1 ms before it writes them, and until then their slots and q hold stale values, each
    enough to put attention far from the oracle (checked first, so the test can fail)."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    bs = 16
    q, k_cache, v_cache, meta, ks, vs, qs = build_case(21, bs, 16, 8, 128, torch.bfloat16, "cuda", num_seqs=4,
                                                      ctx_range=(2, 300) if decode_only else (2, 100))
    if decode_only:
        q_lens = [1] * len(ks)
        qs = [x[-1:] for x in qs]
        q = torch.cat(qs)
        meta.query_start_loc, meta.max_query_len = torch.arange(len(ks) + 1, device="cuda"), 1
    else:
        q_lens = [x.shape[0] for x in qs]
    pos = [p for k, ql in zip(ks, q_lens) for p in range(k.shape[0] - ql, k.shape[0])]
    if not decode_only:     # the case's point: new keys in a first tile (split 0 of 2: keys 0-63), besides old ones
        assert any(k.shape[0] - ql < 64 and k.shape[0] > ql for k, ql in zip(ks, q_lens))
    seq = [s for s, ql in enumerate(q_lens) for _ in range(ql)]
    slots = torch.tensor([meta.block_tables[s, p // bs].item() * bs + p % bs for s, p in zip(seq, pos)], device="cuda")
    k_new = torch.stack([ks[s][p] for s, p in zip(seq, pos)])
    v_new = torch.stack([vs[s][p] for s, p in zip(seq, pos)])
    expected = oracle(ks, vs, qs)
    q_new, q_stale = q.clone(), -4 * q    # attention with q negated puts the weight on other keys

    def make_stale(kv=True, queries=True):
        if kv:
            k_cache.view(-1, 8, 128)[slots], v_cache.view(-1, 8, 128)[slots] = 30.0, -30.0
        if queries:
            q.copy_(q_stale)

    make_stale(kv=False)
    assert (paged_attention_triton(q, k_cache, v_cache, meta).float() - expected).abs().max() > 1.0
    q.copy_(q_new)
    make_stale(queries=False)
    assert (paged_attention_triton(q, k_cache, v_cache, meta).float() - expected).abs().max() > 1.0

    def write_then_attend(spin_ns):
        _slow_store_kv[(len(pos),)](k_new, v_new, k_cache, v_cache, slots, k_new.stride(0), k_cache.stride(1),
                                    q_new, q, SPIN_NS=spin_ns, ROW=8 * 128, Q_ROW=16 * 128, launch_pdl=True)
        return paged_attention_triton(q, k_cache, v_cache, meta, num_splits=None if decode_only else 2, pdl=True,
                                      prefetch_kv=prefetch_kv)

    write_then_attend(0)                # compiles both: a compile between the launches would outlast the spin
    make_stale()
    torch.cuda.synchronize()
    out = write_then_attend(1_000_000)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="the Triton kernel runs on CUDA only")
def test_engine_passes_the_resolved_prefetch_kv_to_the_kernel(tiny_models):
    """The kernel's prefetch follows `EngineConfig.prefetch_kv` as the engine resolves it, also where PDL or
    split-KV is off (the kernel's own default is True)."""
    import minirt
    from minirt.kernels import pdl_missing

    on_hopper = not pdl_missing(torch.device("cuda"))
    for kwargs, want in (({}, on_hopper), ({"pdl": False}, False), ({"split_kv": False}, False),
                         ({"prefetch_kv": False}, False)):
        llm = minirt.LLM(tiny_models["qwen3"], device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                         **kwargs)
        assert llm.engine.plan.prefetch_kv is want, kwargs
        assert llm.engine.model_runner.kernel.keywords["prefetch_kv"] is want, kwargs


@pytest.mark.skipif(not CUDA, reason="the Triton kernel runs on CUDA only")
def test_engine_selects_triton_on_cuda_and_stays_equal(tiny_models):
    """The whole engine with the Triton kernels equals the torch reference token for token (float32)."""
    import minirt
    from conftest import random_prompts
    from minirt.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton

    prompts = random_prompts(11, [1, 7, 16, 17, 40, 63])
    params = minirt.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = minirt.LLM(tiny_models["qwen3"], device="cuda", dtype="float32", block_size=4,
                         max_prefill_chunk=5, max_num_batched_tokens=24, attention_backend=backend)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.model_runner
        kernel, store = (getattr(f, "func", f) for f in (runner.kernel, runner.store))   # pdl: partials
        assert (kernel is paged_attention_triton) == (backend == "triton")
        assert store is (store_kv_triton if backend == "triton" else store_kv)
    assert outs["torch"] == outs["triton"]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_combine_splits_equals_attention_over_all_keys(num_splits):
    """Partial softmaxes over contiguous key shares (some shares empty), combined, against SDPA over all keys."""
    from minirt.fast.attention import combine_splits

    gen = torch.Generator().manual_seed(num_splits)
    T, H, D, N = 3, 4, 16, 10                                  # 10 keys: with 8 splits some shares are empty
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((T, H, D), (N, H, D), (N, H, D)))
    scores = torch.einsum("thd,nhd->thn", q, k) * D ** -0.5     # [T, H, N]
    share = -(-N // num_splits) if num_splits < N else 2
    acc = torch.zeros(T, H, num_splits, D, dtype=torch.float64)
    m = torch.full((T, H, num_splits), float("-inf"), dtype=torch.float64)
    l = torch.zeros(T, H, num_splits, dtype=torch.float64)
    for j in range(num_splits):
        lo, hi = j * share, min(N, (j + 1) * share)
        if lo >= hi:
            continue                                            # an empty split keeps (-inf, 0, 0)
        s = scores[..., lo:hi]
        m[..., j] = s.amax(-1)
        p = torch.exp(s - m[..., j, None])
        l[..., j] = p.sum(-1)
        acc[..., j, :] = torch.einsum("thn,nhd->thd", p, v[lo:hi])
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(combine_splits(acc, m, l), want, atol=1e-12, rtol=1e-12)


STORES = [pytest.param(store_kv, "cpu", id="torch-cpu")]
if CUDA:
    from minirt.kernels.paged_attention_triton import store_kv_triton

    STORES += [pytest.param(store_kv, "cuda", id="torch-cuda"), pytest.param(store_kv_triton, "cuda", id="triton-cuda")]
if INTERPRETER:
    from minirt.kernels.paged_attention_triton import store_kv_triton

    STORES += [pytest.param(store_kv_triton, "cpu", id="triton-interpreter")]


@pytest.mark.parametrize("store,device", STORES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 32), (8, 128), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_to_its_slot_only(store, device, num_kv_heads, head_dim, dtype):
    """Oracle: one token at a time into a copy of the cache; every other slot keeps its old value. k and v are
    slices of one merged projection (strided rows), as the engine passes them."""
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, block_size, num_tokens = 7, 4, 13
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    merged = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = merged[:, 1], merged[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    want_k, want_v = k_cache.clone().view(-1, num_kv_heads, head_dim), v_cache.clone().view(-1, num_kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        want_k[slot], want_v[slot] = k[t], v[t]
    store(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), want_k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), want_v)


def test_attention_kernels_of_a_plan():
    """The reference plan attends with the torch reference; a Triton plan with the Triton kernel and the plan's
    options bound (on the CPU, through the interpreter's module, which imports without a GPU)."""
    pytest.importorskip("triton")
    from minirt.fast import Plan
    from minirt.fast.attention import attention_kernels
    from minirt.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton

    cpu = torch.device("cpu")
    assert attention_kernels(Plan(), cpu, 4, 2) == (paged_attention_reference, store_kv)
    kernel, store = attention_kernels(Plan(attention_backend="triton", pdl=True, prefetch_kv=True), cpu, 4, 2)
    assert kernel.func is paged_attention_triton and kernel.keywords == {"pdl": True, "prefetch_kv": True,
                                                                          "num_splits": 1}
    assert store.func is store_kv_triton and store.keywords == {"pdl": True}
    kernel, _ = attention_kernels(Plan(attention_backend="triton", split_kv=True, combine_in_attention=True), cpu, 4, 2)
    assert "num_splits" not in kernel.keywords and kernel.keywords["split_counters"].shape == (8,)


def test_store_kv_triton_refuses_what_it_cannot_write():
    """Each argument it cannot handle is named; the checks run before any kernel, so CPU tensors do."""
    pytest.importorskip("triton")
    from minirt.kernels.paged_attention_triton import store_kv_triton

    cache, k, slots = torch.zeros(3, 4, 2, 8), torch.randn(5, 2, 8), torch.arange(5)
    with pytest.raises(ValueError, match=r"^v: must have k's shape"):
        store_kv_triton(cache, cache.clone(), k, torch.randn(4, 2, 8), slots)
    with pytest.raises(ValueError, match=r"^k_cache/v_cache: must be contiguous"):
        store_kv_triton(cache, torch.zeros(3, 2, 4, 8).transpose(1, 2), k, k.clone(), slots)
    with pytest.raises(ValueError, match=r"^k_cache: must be \[num_blocks, block_size, 2, 8\]"):
        store_kv_triton(torch.zeros(3, 4, 1, 16), torch.zeros(3, 4, 1, 16), k, k.clone(), slots)
    with pytest.raises(ValueError, match=r"^slot_mapping: must be a contiguous \[5\]"):
        store_kv_triton(cache, cache.clone(), k, k.clone(), torch.arange(10)[::2])
    with pytest.raises(ValueError, match=r"^k_cache/v_cache: must be torch.float32 like k, got torch.float32 and "
                                         r"torch.bfloat16"):
        store_kv_triton(cache, cache.to(torch.bfloat16), k, k.clone(), slots)
