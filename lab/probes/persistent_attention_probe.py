"""Tried and dropped (2026-12-01): decode attention as a persistent Triton kernel, against minirt's.

    python lab/probes/persistent_attention_probe.py [--out lab/results/persistent-attention]

`minirt.kernels.paged_attention_triton` launches one program per (sequence, KV head) of a decode batch: at 256
sequences 2,048 programs of 1 to 9 tiles of keys, each paying its own ramp (the first tile's load latency), and a
launch that ends on a ragged tail. The kernel below takes a grid of k x the SM count; each program walks a fixed
share of the (sequence, KV head) items in *one* loop over their tiles, so that the software pipeline runs across item
boundaries. Items go longest context first (`decode_order`), dealt in snake order (0 .. G-1, then G-1 .. 0, ...),
which balances the programs' sums of tiles without atomics (Graham's longest-processing-time list scheduling);
Triton's persistent matmul tutorial flattens its loops the same way.

It lost to minirt's kernel, so it is not in the package (the figures: `lab/pages/persistent-attention.md`). Each
variant is checked against minirt's kernel (bf16, max abs difference in the JSON) and, once, against
`paged_attention_reference` in float32. Times are us per launch in CUDA graphs of 28 launches (one per
layer). Needs CUDA.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from harness import cuda_graph_seconds, cuda_script_args  # noqa: E402
from minirt.attention import PagedAttentionMetadata, paged_attention_reference  # noqa: E402
from minirt.bench import make_prompts, report_header, write_report  # noqa: E402
from minirt.kernels import num_sms  # noqa: E402
from minirt.kernels.paged_attention_triton import _attend_tile, paged_attention_triton  # noqa: E402

PERSISTENT_TILE = (128, 4, 2)          # (BLOCK_N keys, num_warps, num_stages), as paged attention's DECODE_TILE


@triton.jit(do_not_specialize=["stride_bt", "num_items"])
def _persistent_decode_kernel(
    Q, K, V, Out, block_tables, context_lens, order, num_items, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUNDS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # This program's items, round j: j * G + pid in even rounds, j * G + G - 1 - pid in odd ones (snake order).
    j = tl.arange(0, ROUNDS)
    items = j * G + tl.where(j % 2 == 0, pid, G - 1 - pid)
    valid = items < num_items
    seqs = tl.load(order + items // NUM_KV_HEADS, mask=valid, other=0)
    ctxs = tl.load(context_lens + seqs, mask=valid, other=0)
    total = tl.sum(tl.cdiv(ctxs, BLOCK_N), 0)             # tiles of keys over all this program's items

    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP                                    # one token per sequence: GROUP query rows per item
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    round_ = tl.full((), 0, tl.int32)
    tile = tl.full((), 0, tl.int32)
    for _ in range(0, total):
        pick = j == round_
        seq = tl.sum(tl.where(pick, seqs, 0), 0)
        ctx = tl.sum(tl.where(pick, ctxs, 0), 0)
        item = tl.sum(tl.where(pick, items, 0), 0)
        head = (item % NUM_KV_HEADS) * GROUP + r % GROUP
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < ctx
        block = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        kv_row = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + (item % NUM_KV_HEADS) * stride_kh
        offs = kv_row[:, None] + d[None, :]
        k = tl.load(K + offs, mask=n_ok[:, None], other=0.0)
        v = tl.load(V + offs, mask=n_ok[:, None], other=0.0)
        q = tl.load(Q + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = tl.zeros([BLOCK_M], tl.int32) + ctx - 1   # the new token is the sequence's last position
        m_i, l_i, acc = _attend_tile(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale, IEEE)
        last = (tile + 1) * BLOCK_N >= ctx                # this item's last tile: write its output, start the next
        keep = row_ok & (tl.zeros([BLOCK_M], tl.int32) + last.to(tl.int32) != 0)     # a [BLOCK_M] mask
        tl.store(Out + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=keep[:, None])
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)
        tile = tl.where(last, 0, tile + 1)
        round_ = tl.where(last, round_ + 1, round_)


def decode_order(context_lens: torch.Tensor) -> torch.Tensor:
    """The sequences of a decode batch, longest context first: `[num_seqs]` int64 indices (on the device; no sync,
    so a CUDA graph can capture it)."""
    return torch.argsort(context_lens, descending=True, stable=True)


def persistent_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: PagedAttentionMetadata, order: torch.Tensor | None = None,
                                num_programs: int | None = None, pdl: bool = False,
                                tile: tuple[int, int, int] = PERSISTENT_TILE) -> torch.Tensor:
    """q `[num_seqs, H, D]` (one new token per sequence), k/v cache `[num_blocks, block_size, Hkv, D]` ->
    `[num_seqs, H, D]`.

    order: the sequences longest first (`decode_order(meta.context_lens)`; None computes it here). num_programs:
    the grid (default: the device's SM count). pdl: programmatic dependent launch, as in
    `minirt.kernels.paged_attention_triton.paged_attention_triton`. tile: (BLOCK_N keys, num_warps, num_stages).
    Raises ValueError naming meta.max_query_len for a batch that is not all decodes.
    """
    if meta.max_query_len != 1:
        raise ValueError(f"meta.max_query_len: the persistent kernel takes decode batches only (1 new token per "
                         f"sequence), got {meta.max_query_len}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    order = decode_order(meta.context_lens) if order is None else order
    grid = num_programs or num_sms(q.device)
    num_items = num_seqs * num_kv_heads
    block_n, warps, stages = tile
    out = torch.empty_like(q)
    block_tables = meta.block_tables.contiguous()
    launch = {"launch_pdl": True} if pdl else {}
    _persistent_decode_kernel[(grid,)](
        q, k_cache, v_cache, out, block_tables, meta.context_lens, order, num_items, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, NUM_KV_HEADS=num_kv_heads,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        ROUNDS=max(2, triton.next_power_of_2(triton.cdiv(num_items, grid))), IEEE=q.dtype == torch.float32,
        PDL=pdl, num_warps=warps, num_stages=stages, **launch)
    return out


BS, HKV, H, D, LAYERS = 16, 8, 16, 128, 28
TILES = ((128, 4, 2), (128, 4, 3), (64, 4, 3), (64, 4, 2), (128, 8, 2), (64, 2, 3))


def graph_us(fn) -> float:
    """us per launch: `fn` (LAYERS launches) captured in a CUDA graph, the median of 15 replays."""
    return cuda_graph_seconds(fn) * 1e6 / LAYERS


def main(argv=None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, out_dir=str(REPO / "lab" / "results" / "persistent-attention"))
    if args is None:
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lengths = [len(p) for p in make_prompts(256, (100, 1024), 151936, 0)]   # the throughput workload's prompts
    width = -(-(1024 + 512) // BS)
    blocks = 256 * width + 1
    k_cache = torch.randn(blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(blocks - 1, device=dev)
    sms = num_sms(dev)

    def meta_for(n, step, tables=None):
        ctx = torch.tensor([x + step for x in lengths[:n]], device=dev)
        tables = perm[:n * width].view(n, width) if tables is None else tables
        return PagedAttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
                                      query_start_loc=torch.arange(n + 1, device=dev), context_lens=ctx,
                                      block_tables=tables, max_query_len=1, max_context_len=int(ctx.max()))

    report = {**report_header(dev), "sms": sms, "rows": []}
    for n, step in ((256, 0), (256, 256), (256, 511), (128, 256), (64, 256)):
        meta = meta_for(n, step)
        q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16)
        kv_bytes = int(meta.context_lens.sum()) * HKV * D * 2 * 2
        base = paged_attention_triton(q, k_cache, v_cache, meta)
        row = {"seqs": n, "step": step, "kv_mb": kv_bytes / 1e6}
        for pdl in (False, True):
            row[f"current pdl={pdl}"] = graph_us(
                lambda: [paged_attention_triton(q, k_cache, v_cache, meta, pdl=pdl) for _ in range(LAYERS)])
        order, natural = decode_order(meta.context_lens), torch.arange(n, device=dev)
        for tile in TILES:
            for mult in (1, 2):
                for name, o in (("sorted", order), ("natural", natural)):
                    for pdl in (False, True):
                        if name == "natural" and (tile != TILES[0] or mult != 1 or pdl):
                            continue
                        key = f"persistent tile={tile} grid={mult}xSM {name} pdl={pdl}"
                        call = lambda: persistent_decode_attention(q, k_cache, v_cache, meta, order=o,  # noqa: E731
                                                                   num_programs=mult * sms, pdl=pdl, tile=tile)
                        row[key + " err"] = (call().float() - base.float()).abs().max().item()
                        row[key] = graph_us(lambda: [call() for _ in range(LAYERS)])
        row["argsort_us"] = graph_us(lambda: [decode_order(meta.context_lens) for _ in range(LAYERS)])
        report["rows"].append(row)
        current = row["current pdl=True"]
        best = min((v, k) for k, v in row.items() if k.startswith("persistent") and not k.endswith("err"))
        print(f"seqs={n} step={step}: minirt's kernel {current:.1f} us ({kv_bytes / current / 1e6:.2f} TB/s), best "
              f"persistent {best[0]:.1f} us ({best[0] / current:.3f}x) {best[1]}")
    n = 40
    qf = torch.randn(n, H, D, device=dev)
    kf, vf = k_cache[:n * width + 1].float(), v_cache[:n * width + 1].float()
    meta = meta_for(n, 100, torch.arange(n * width, device=dev).view(n, width))
    report["float32_err_vs_reference"] = (persistent_decode_attention(qf, kf, vf, meta, tile=(32, 4, 2))
                                          - paged_attention_reference(qf, kf, vf, meta)).abs().max().item()
    print("float32, max abs difference from paged_attention_reference:", report["float32_err_vs_reference"])
    write_report(report, args.out, f"persistent-attention-probe-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
