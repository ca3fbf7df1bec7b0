"""Paged attention as one Triton kernel: no gathered copy of the K/V, any mix of prefill chunks and decodes.

One program handles one sequence, one KV head and a tile of its new tokens. The query rows of the tile
are (token, query head of this KV head's group) pairs, so grouped-query attention reads each K/V block
once for the whole group. The program walks the sequence's block table `BLOCK_N` keys at a time and keeps
a running softmax (max, sum, weighted values), as FlashAttention does (Dao et al. 2022, algorithm 1;
vLLM's `unified_attention` Triton kernel and FlashInfer work the same way on paged K/V).

A small decode batch gives few programs (batch 1 of an 8-KV-head model: 8, on a GPU with 132 SMs), each
walking the whole context alone. Split-KV lets several programs share one sequence's keys, each keeping
its own running softmax, and a second kernel combines them (chapter 07).

Same contract as `minirt.attention.paged_attention_reference`, which the tests compare it with.
`store_kv_triton` is the backend's K/V write: `minirt.attention.store_kv` in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirt.attention import PagedAttentionMetadata
from minirt.kernels import num_sms


@triton.jit(do_not_specialize=["stride_bt"])     # the block tables' width changes every step: one compile serves all
def _paged_attention_kernel(
    Q, K, V, Out, PartAcc, PartM, PartL, Counters, block_tables, context_lens, query_start_loc, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LAST_COMBINES: tl.constexpr, ROWS: tl.constexpr = 0,
):
    if PDL:     # programmatic dependent launch: this kernel may start while the one before it runs
        tl.extra.cuda.gdc_launch_dependents()
        if not PREFETCH:
            tl.extra.cuda.gdc_wait()      # every load after the kernel before has finished
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ROWS == 2:
        # Longest first: a causal chunk's later tiles see the most keys, so they start in the first waves and the
        # launch ends on short tiles (FlashAttention-2's causal scheduling). The chunk launch never splits.
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        split = 0
    else:
        tile = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
    TOKENS: tl.constexpr = BLOCK_M // GROUP           # new tokens per tile
    # With PREFETCH, before the wait only what no kernel of this forward pass writes: the step's metadata and
    # the keys and values of earlier steps (see `paged_attention_triton`, pdl).
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    ctx = tl.load(context_lens + seq)
    skip = tile * TOKENS >= q_len
    if ROWS == 1:                                         # this launch takes the one-token sequences only
        skip = skip | (q_len != 1)
    elif ROWS == 2:                                       # ... and this one the others (see ROWS_ALL)
        skip = skip | (q_len == 1)
    if skip:
        if PDL:
            tl.extra.cuda.gdc_wait()      # every program waits before it ends: completion stays in order
        return

    r = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (tok < q_len) & (r < TOKENS * GROUP)
    d = tl.arange(0, HEAD_DIM)
    q_pos = ctx - q_len + tok                             # absolute position of each query row
    first_new = ctx - q_len                               # keys from here on are this step's: written just before

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last = tl.minimum(ctx, ctx - q_len + (tile + 1) * TOKENS)   # keys beyond the tile's last row are masked
    # Split-KV (flash-decoding): program `split` of NUM_SPLITS takes one contiguous share of the keys.
    share = tl.cdiv(tl.cdiv(last, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * share
    hi = tl.minimum(last, lo + share)
    if ROWS == 2:
        # A prefill chunk's tile (one split, no prefetch): FlashAttention's causal split of the key loop. Keys before
        # the tile's first query position are visible to all its rows, so whole tiles of them need no mask; the
        # rest, up to the tile's last query position, take the masked loop (one or two tiles of keys).
        q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        qk_scale = scale * 1.4426950408889634             # log2(e): a base-2 softmax, see _attend_tile_exp2
        full = (first_new + tile * TOKENS) // BLOCK_N * BLOCK_N
        for start in range(0, full, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            n = start + tl.arange(0, BLOCK_N)
            offs = _kv_offsets(block_tables + seq * stride_bt, n, None, kv_head, d, stride_kb, stride_ks, stride_kh,
                               BLOCK_SIZE)
            k = tl.load(K + offs)
            v = tl.load(V + offs)
            m_i, l_i, acc = _attend_tile_exp2(q, k, v, n, None, q_pos, m_i, l_i, acc, qk_scale, IEEE, False)
        for start in range(full, hi, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            offs = _kv_offsets(block_tables + seq * stride_bt, n, n_ok, kv_head, d, stride_kb, stride_ks, stride_kh,
                               BLOCK_SIZE)
            k = tl.load(K + offs, mask=n_ok[:, None], other=0.0)
            v = tl.load(V + offs, mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile_exp2(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, qk_scale, IEEE, True)
    else:
        start = lo
        if PREFETCH:
            # The first BLOCK_N keys: earlier steps' keys and values load before the wait, so that their memory
            # latency overlaps the kernel before (a decode's whole share when it has up to NUM_SPLITS * BLOCK_N keys);
            # this step's load after it, in place of the masked-out rows.
            n = lo + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            offs = _kv_offsets(block_tables + seq * stride_bt, n, n_ok, kv_head, d, stride_kb, stride_ks, stride_kh,
                               BLOCK_SIZE)
            old = n_ok & (n < first_new)
            k = tl.load(K + offs, mask=old[:, None], other=0.0)
            v = tl.load(V + offs, mask=old[:, None], other=0.0)
            if PDL:
                tl.extra.cuda.gdc_wait()                      # q and this step's keys are the kernel before's output
            q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            new = n_ok & (n >= first_new)
            k = tl.where(new[:, None], tl.load(K + offs, mask=new[:, None], other=0.0), k)
            v = tl.where(new[:, None], tl.load(V + offs, mask=new[:, None], other=0.0), v)
            m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale, IEEE)
            start = lo + BLOCK_N
        else:
            q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
        for start in range(start, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            offs = _kv_offsets(block_tables + seq * stride_bt, n, n_ok, kv_head, d, stride_kb, stride_ks, stride_kh,
                               BLOCK_SIZE)
            k = tl.load(K + offs, mask=n_ok[:, None], other=0.0)
            v = tl.load(V + offs, mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale, IEEE)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:   # partial results, [num_tokens, num_heads, NUM_SPLITS, (HEAD_DIM)], combined by _combine_splits_kernel
        row = ((q_start + tok) * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(PartAcc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(PartM + row, m_i, mask=row_ok)
        tl.store(PartL + row, l_i, mask=row_ok)
        if LAST_COMBINES:
            _last_split_combines(Out, PartAcc, PartM, PartL, Counters, row - split, q_start + tok, head, row_ok,
                                 (seq * tl.num_programs(1) + kv_head) * (tl.num_programs(2) // NUM_SPLITS) + tile,
                                 stride_ot, stride_oh, BLOCK_M, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _kv_offsets(table, n, n_ok, kv_head, d, stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr):
    """Offsets `[BLOCK_N, HEAD_DIM]` of keys `n`'s rows for one KV head in the paged K (or V) cache, through `table`,
    the sequence's row of the block tables; keys outside `n_ok` read block 0 (None: every key is in the table)."""
    if n_ok is None:
        block = tl.load(table + n // BLOCK_SIZE)
    else:
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
    kv_row = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    return kv_row[:, None] + d[None, :]


@triton.jit
def _attend_tile(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One step of the running softmax over the keys `n` (`[BLOCK_N]`; k and v `[BLOCK_N, HEAD_DIM]`, zero where
    masked): a query row sees the keys at or before its position. Returns the new (m_i, l_i, acc)."""
    s = _dot(q, tl.trans(k), IEEE) * scale
    s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no visible key yet: no NaN
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """`tl.dot`, in full float32 precision where IEEE (float32 inputs: no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile_exp2(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, MASK: tl.constexpr):
    """`_attend_tile` in base 2, for prefill chunks: qk_scale is scale * log2(e) and m_i the running maximum of
    qk_scale * q.k, so exp2(qk_scale * q.k - m_i) is the same weight as exp(scale * q.k - m_i / log2(e)), with the
    scale and the subtraction in one FMA (FlashAttention-2 and Triton's fused-attention tutorial do the same).
    l_i and acc do not depend on the base, so the output is the same. MASK False: every key is visible to every
    row, so there is neither mask nor the guard for a row with no visible key."""
    s = _dot(q, tl.trans(k), IEEE)
    if MASK:
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no visible key yet: no NaN
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    p = tl.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _last_split_combines(Out, PartAcc, PartM, PartL, Counters, row0, token, head, row_ok, counter,
                         stride_ot, stride_oh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    """The combine of `_combine_splits_kernel`, done by whichever split of a (sequence, KV head, tile) finishes
    last, so that no second kernel is launched. Each split counts itself in with an atomic add on the group's
    counter after its partial results are stored; the one that draws NUM_SPLITS - 1 knows the others' results are
    written, combines the rows row0 .. row0 + NUM_SPLITS - 1 of each query row, and sets the counter back to 0
    for the next launch (CUTLASS's serial split-K reduction and the CUDA sample `threadFenceReduction` use
    the same "last block" pattern).

    Memory order: the barrier puts every thread's stores before the count, whose release (gpu scope) makes
    them visible to the program that acquires the final count; that program reads with `.cg` (from L2, not a
    possibly stale L1 line of an earlier launch)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(Counters + counter, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:
        tl.atomic_xchg(Counters + counter, 0, sem="relaxed", scope="gpu")
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(PartM + row0[:, None] + s[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        big_m = tl.max(m, 1)                                                   # M, per query row
        l = tl.load(PartL + row0[:, None] + s[None, :], mask=row_ok[:, None], other=1.0, cache_modifier=".cg")
        out = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for j in tl.static_range(NUM_SPLITS):                                # one split's [BLOCK_M, HEAD_DIM] at a time
            m_j = tl.load(PartM + row0 + j, mask=row_ok, other=0.0, cache_modifier=".cg")
            w_j = tl.exp(m_j - big_m)
            acc = tl.load(PartAcc + (row0 + j)[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                          cache_modifier=".cg")
            out += w_j[:, None] * acc
        out = out / tl.sum(tl.exp(m - big_m[:, None]) * l, 1)[:, None]
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(Out, PartAcc, PartM, PartL, stride_ot, stride_oh,
                           HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s (an empty split has m_s = -inf)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(PartM + row + s)
    w = tl.exp(m - tl.max(m, 0))
    acc = tl.load(PartAcc + (row + s)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * tl.load(PartL + row + s), 0)
    tl.store(Out + token * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty))


ROWS_ALL, ROWS_ONE_TOKEN, ROWS_CHUNKS = 0, 1, 2
# Tiles by kind of launch: (BLOCK_N keys, num_warps, num_stages), and for prefill chunks BLOCK_M query rows too.
# A decode tile holds one token's query group: rows are cheap, the keys streamed per iteration are what counts.
# A chunk tile holds CHUNK_BLOCK_M rows, so that each K/V tile it loads serves many query rows. The sweeps behind
# these choices: lab/probes/prefill_kernels.py (chunk tiles) and lab/probes/split_tile.py (the split-KV tile).
DECODE_TILE = (128, 4, 2)          # one program per (sequence, KV head)
SPLIT_TILE = (64, 8, 2)            # split-KV launches: their shares and the K/V prefetch are sized by 64 keys
CHUNK_BLOCK_M, CHUNK_TILE = 128, (32, 4, 2)
CHUNK_MIN_TOKENS = 16              # a step whose longest chunk is shorter keeps one launch of decode-sized tiles
MAX_SPLITS = 16                    # split-KV: programs per (sequence, KV head) at most


def choose_num_splits(meta: PagedAttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """How many programs share each decode's keys: 1 unless the batch is all decodes and has fewer
    (sequence, KV head) programs than twice the GPU's SMs; then a power of two up to MAX_SPLITS that fills them.
    Depends only on the batch's shape, so a CUDA graph captured at one batch size keeps it."""
    if meta.max_query_len != 1 or device.type != "cuda":
        return 1
    return splits_for(meta.context_lens.shape[0] * num_kv_heads, device)


def splits_for(programs: int, device: torch.device) -> int:
    """`choose_num_splits` for a decode batch of `programs` (sequence, KV head) pairs: the power of two up to
    MAX_SPLITS that gives at least twice the GPU's SMs in programs (1 where `programs` already does)."""
    target = 2 * num_sms(device)
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, -(-target // programs))))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, num_splits: int | None = None, pdl: bool = False,
                           split_counters: torch.Tensor | None = None, prefetch_kv: bool = True,
                           chunk_tile: tuple[int, int, int] | None = None,
                           chunk_block_m: int | None = None):
    """q `[num_tokens, H, D]`, k/v cache `[num_blocks, block_size, Hkv, D]` -> `[num_tokens, H, D]`.

    One launch for a decode batch; a step whose chunks have `CHUNK_MIN_TOKENS` new tokens or more (and no split-KV)
    takes two, one for its one-token sequences and one with larger query tiles (`CHUNK_BLOCK_M` rows) for the
    chunks, so that each K/V tile loaded serves many query rows (FlashAttention's tiling) while decodes keep tiles
    sized for one token. The chunk launch starts with the chunks' last tiles, which see the most keys, and walks the
    keys that all of a tile's rows see without a mask (FlashAttention-2's causal scheduling and loop split).

    num_splits: programs per (sequence, KV head) that share its keys (a power of two; split-KV, Dao et al.
    2023, "Flash-Decoding for long-context inference"; FlashAttention's `num_splits`). None chooses with
    `choose_num_splits`: more than 1 only for small all-decode batches, which otherwise leave most SMs idle.
    pdl: launch both kernels with programmatic dependent launch (see `minirt.kernels.gemv_triton.linear_gemv`):
    each may start while the kernel before it finishes, which hides the launch. The combine kernel waits for
    attention before its first load; so does the attention kernel with prefetch_kv=False.
    prefetch_kv (acts with num_splits > 1, i.e. small decode batches; it pays only with pdl, and the engine passes
    the plan's `prefetch_kv`, `minirt.fast.attention.attention_kernels`): the attention kernel loads the metadata
    and its first tile of keys and values from earlier steps before it waits (`griddepcontrol.wait`), and q and
    this step's keys (positions from `context_lens - query_len` on) after, so that those loads overlap the kernel
    before, as the weight loads of `linear_gemv` do. A split's share is then often that one tile. With one program
    per sequence (large batches, prefill chunks) the kernel waits first: there one tile loaded early hides little
    of a walk over many tiles, and peeling it out of the loop costs more than that. The caller guarantees that
    what loads before the wait was written before the current run of PDL launches began: by host copies, or by
    an earlier forward pass with a kernel launched without PDL in between, which starts only once everything
    before it has finished (minirt's forward pass starts with torch's embedding gather). Needs
    `minirt.kernels.pdl_missing(q.device)` empty; not checked here.
    split_counters: None combines split results with a second kernel. A zeroed int32 tensor of at least
    `num_seqs * Hkv * query tiles` elements (one per group of splits; a decode batch has one query tile per
    sequence, `split_counters_for`) lets the last split of each (sequence, KV head, query tile) to finish combine
    them inside the attention kernel instead (one launch fewer; see `_last_split_combines`). The kernel
    leaves it zeroed again, so one buffer serves every launch on a stream, CUDA graph replays included. Raises
    ValueError naming split_counters if it is too small or not int32 on q's device.
    chunk_tile, chunk_block_m: the chunk launch's (BLOCK_N, num_warps, num_stages) and query rows per tile, in place
    of `CHUNK_TILE` and `CHUNK_BLOCK_M` (None; rows a power of two), so that the sweep behind those constants
    (`lab/probes/prefill_kernels.py`) compares tilings in one process.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group
    if num_splits is None:
        num_splits = choose_num_splits(meta, num_kv_heads, q.device)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out                       # unused
    grid = (meta.context_lens.shape[0], num_kv_heads,
            triton.cdiv(meta.max_query_len, tokens_per_tile) * num_splits)
    last_combines = num_splits > 1 and split_counters is not None
    if last_combines:
        need = grid[0] * grid[1] * (grid[2] // num_splits)
        if (split_counters.dtype != torch.int32 or split_counters.device != q.device
                or not split_counters.is_contiguous() or split_counters.numel() < need):
            raise ValueError(f"split_counters: must be a contiguous int32 tensor on {q.device} with at least {need} "
                             f"elements (sequences x KV heads x query tiles), got {split_counters.dtype}, "
                             f"{split_counters.numel()} elements on {split_counters.device}")
    block_tables = meta.block_tables.contiguous()
    launch = {"launch_pdl": True} if pdl else {}
    args = (q, k_cache, v_cache, out, part_acc, part_m, part_l, split_counters if last_combines else out,
            block_tables, meta.context_lens, meta.query_start_loc, head_dim ** -0.5,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1))
    common = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, IEEE=q.dtype == torch.float32, PDL=pdl,
                  **launch)
    if num_splits == 1 and meta.max_query_len >= CHUNK_MIN_TOKENS:
        # A step with long prefill chunks: two launches over all its sequences, each taking one kind and skipping
        # the other's (a skipped program returns at once). Chunks get tiles of CHUNK_BLOCK_M query rows; one-token
        # rows in such tiles would waste all but GROUP rows of every product, so they keep the decode tiles.
        block_n, warps, stages = DECODE_TILE
        _paged_attention_kernel[grid[:2] + (1,)](
            *args, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=1, PREFETCH=False, LAST_COMBINES=False,
            ROWS=ROWS_ONE_TOKEN, num_warps=warps, num_stages=stages, **common)
        chunk_m = max(CHUNK_BLOCK_M if chunk_block_m is None else chunk_block_m, block_m)
        block_n, warps, stages = CHUNK_TILE if chunk_tile is None else chunk_tile
        _paged_attention_kernel[grid[:2] + (triton.cdiv(meta.max_query_len, chunk_m // group),)](
            *args, BLOCK_M=chunk_m, BLOCK_N=block_n, NUM_SPLITS=1, PREFETCH=False, LAST_COMBINES=False,
            ROWS=ROWS_CHUNKS, num_warps=warps, num_stages=stages, **common)
        return out
    block_n, warps, stages = SPLIT_TILE if num_splits > 1 else DECODE_TILE
    _paged_attention_kernel[grid](
        *args, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, PREFETCH=prefetch_kv and num_splits > 1,
        LAST_COMBINES=last_combines, ROWS=ROWS_ALL, num_warps=warps, num_stages=stages, **common)
    if num_splits > 1 and not last_combines:
        _combine_splits_kernel[(num_tokens, num_heads)](out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
                                                        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PDL=pdl, **launch)
    return out


def split_counters_for(max_num_seqs: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed int32 buffer `paged_attention_triton(split_counters=...)` counts finished splits in, for decode
    batches of up to max_num_seqs sequences (one query tile each). Allocate it once, before any CUDA graph
    capture; the kernel keeps it zeroed between launches."""
    return torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, slot_mapping, stride_kt, stride_vt, stride_slot,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(KCache + slot * stride_slot + offs, tl.load(K + token * stride_kt + offs, mask=mask), mask=mask)
    tl.store(VCache + slot * stride_slot + offs, tl.load(V + token * stride_vt + offs, mask=mask), mask=mask)


def store_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, pdl: bool = False) -> None:
    """`minirt.attention.store_kv` as one kernel for keys and values: one program per token copies its
    `Hkv * D` keys and values into its slot (vLLM's `reshape_and_cache_flash`): one launch where torch's two
    indexed assignments take two.

    k_cache/v_cache `[num_blocks, block_size, Hkv, D]` (contiguous, same shape); k/v `[num_tokens, Hkv, D]`
    (same shape), each token's `Hkv * D` values contiguous (rows may be strided, as slices of a merged q/k/v
    projection are); slot_mapping `[num_tokens]` contiguous. Raises ValueError naming the argument otherwise.
    Slots are not range-checked (that would need a device sync): each must be in `[0, num_blocks * block_size)`,
    as the block pool hands them out. pdl: as in `paged_attention_triton`.
    """
    check_store_kv_args(k_cache, v_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    k_cache.stride(1), ROW=row, BLOCK=triton.next_power_of_2(row), PDL=pdl,
                                    **({"launch_pdl": True} if pdl else {}))


def check_store_kv_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """The layouts `store_kv_triton` (and `norm_rotate_and_store_triton`) write, or ValueError naming the argument."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v: must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k_cache.dtype != k.dtype or v_cache.dtype != k.dtype:
        raise ValueError(f"k_cache/v_cache: must be {k.dtype} like k, got {k_cache.dtype} and {v_cache.dtype}")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: must be contiguous and of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache: must be [num_blocks, block_size, {num_kv_heads}, {head_dim}] like k, "
                         f"got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (num_tokens,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: must be a contiguous [{num_tokens}] tensor, got shape "
                         f"{tuple(slot_mapping.shape)}, strides {tuple(slot_mapping.stride())}")
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"k/v: each token's {num_kv_heads} x {head_dim} values must be contiguous, "
                             f"got strides {tuple(x.stride())}")
