"""The kernels of a step with prefill chunks, this tree's against a base tree's, at the throughput workload's shapes.

    python lab/probes/prefill_kernels.py --base work/base [--out lab/results/prefill-kernels]

A step of the throughput workload with prefill chunks carries 8,192 tokens through Qwen3-0.6B's 28 layers; its
profile (`lab/pages/prefill-kernels.md`) puts SwiGLU's SiLU-and-multiply (`torch.compile`'s kernel) at 86 us a
layer, the q/k norm,
rotation and K/V write at 74 us and the chunks' attention at ~250 us, where the first two need about 35 and 31 us
for their bytes at the copy bandwidth. This times, in one process, each of them as this tree runs it and as the tree
under `--base` (a folder holding a `minirt/`, e.g. `git archive REV minirt | tar -x -C work/base`) runs it, plus the
tile options this tree's kernels take, at 8,192 rows and at a decode burst's 256; and decode attention at 256
sequences, to see that it did not move. Each timing is a median over replays of one CUDA graph holding several calls,
on buffers larger than the L2 cache where the engine's are; each variant's output is checked against the base
kernel's (max difference, and for the SiLU the share of elements that differ from eager torch). Writes
`prefill-kernels-cuda-<date>.json` with the commit. Needs CUDA.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from harness import cuda_graph_seconds, cuda_script_args  # noqa: E402
from minirt.attention import PagedAttentionMetadata  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 16, 8, 128, 1024, 3072, 16      # Qwen3-0.6B


def load_base(base: str, name: str):
    """The base tree's `minirt/kernels/<name>.py` as a module of its own (it imports the rest from this tree)."""
    path = os.path.join(base, "minirt", "kernels", name + ".py")
    spec = importlib.util.spec_from_file_location(f"base_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def us(calls) -> float:
    """us per call of `calls` (a list of callables), all captured in one CUDA graph: the median of 15 replays. A graph,
    because launching from Python takes longer than many of these kernels run (a one-token launch timed alone
    reads the host's 65 us)."""
    return cuda_graph_seconds(lambda: [call() for call in calls]) * 1e6 / len(calls)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def silu_rows(base_fused, report: dict) -> None:
    """SiLU-and-multiply of a merged gate/up `[rows, 2 * I]` (28 such buffers, as 28 layers use 28)."""
    from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton
    from minirt.model.layers import silu_and_mul

    compiled = base_fused(silu_and_mul)
    for rows in (8192, 256):
        copies = 4 if rows == 8192 else 28                  # as many calls on as many buffers: no call finds its input in L2
        merged = [torch.randn(1, rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(copies)]
        halves = [m.chunk(2, dim=-1) for m in merged]
        eager = silu_and_mul(*halves[0])
        row = {"rows": rows, "bytes": 3 * rows * INTERMEDIATE * 2}
        calls = {"torch.compile": [lambda h=h: compiled(*h) for h in halves],
                 "eager": [lambda h=h: silu_and_mul(*h) for h in halves]}
        for br, bc, warps in ((8, 512, 4), (4, 1024, 4), (16, 256, 4), (8, 1024, 8), (2, 1024, 4), (32, 128, 4),
                              (1, 2048, 8), (16, 512, 8), (4, 512, 4), (8, 256, 4)):
            calls[f"triton {br}x{bc} w{warps}"] = [
                lambda h=h, br=br, bc=bc, w=warps: silu_and_mul_triton(*h, block_rows=br, block_cols=bc, num_warps=w)
                for h in halves]
        for key, call in calls.items():
            out = call[0]()
            row[key + " us"] = us(call)
            row[key + " differs from eager"] = (out != eager).float().mean().item()
        report["silu_and_mul"].append(row)
        print(f"silu_and_mul rows={rows}: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith(" us")))


def rotary_rows(base_rotary, report: dict) -> None:
    """The q/k norm, rotation and K/V write of a packed step (`norm_rotate_and_store_triton`), q/k/v slices of one
    merged projection; slots of shuffled blocks as the block pool hands them out."""
    from minirt.kernels import rotary_triton

    for tokens in (8192, 256, 1):
        copies = 4 if tokens == 8192 else 28                # calls per graph, each on its own q/k/v
        qkvs = [torch.randn(1, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                for _ in range(copies)]
        inputs = [tuple(x.view(1, tokens, -1, HEAD_DIM)
                        for x in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
                  for qkv in qkvs]
        angles = torch.rand(1, tokens, HEAD_DIM // 2, device="cuda") * 50
        cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
        sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
        qw, kw = (1 + 0.3 * torch.randn(2, HEAD_DIM, device="cuda")).to(torch.bfloat16)
        num_blocks = -(-tokens // BLOCK) + 1
        blocks = torch.randperm(num_blocks, device="cuda")[: -(-tokens // BLOCK)]
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()[:tokens].contiguous()
        caches = {name: [torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2)] for name in ("base", "this")}
        row = {"tokens": tokens}
        variants = {"base": [lambda x=x: base_rotary.norm_rotate_and_store_triton(*x, cos, sin, qw, kw, 1e-6,
                                                                                 *caches["base"], slots)
                             for x in inputs]}
        for name, kwargs in rotary_variants(tokens):
            variants[name] = [lambda x=x, kw_=kwargs: rotary_triton.norm_rotate_and_store_triton(
                *x, cos, sin, qw, kw, 1e-6, *caches["this"], slots, **kw_) for x in inputs]
        want = variants["base"][0]()
        want_kv = [c.clone() for c in caches["base"]]
        for name, call in variants.items():
            got = call[0]()
            if name != "base":        # q, and the K/V written, against the base kernel's on the same input
                row[name + " max diff"] = max(max_diff(got, want), *(max_diff(c, w) for c, w in zip(caches["this"],
                                                                                                  want_kv)))
            row[name + " us"] = us(call)
        report["rotary"].append(row)
        print(f"rotary tokens={tokens}: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith(" us")))


def rotary_variants(tokens: int) -> list[tuple[str, dict]]:
    """This tree's rotary kernel: its default, then, for many tokens, the tile options it takes (`tokens_per_program`,
    `num_warps`)."""
    variants = [("this", {})]
    if tokens >= 64:
        variants += [(f"this t{tpp} w{warps}", {"tokens_per_program": tpp, "num_warps": warps})
                     for tpp in (1, 2, 4, 8) for warps in (2, 4, 8)]
    return variants


def attention_step(seqs: list[tuple[int, int]], seed: int) -> tuple:
    """q, K/V caches and metadata of one step: seqs are (new tokens, context length) pairs; every sequence's blocks
    are shuffled ids of one large pool."""
    gen = random.Random(seed)
    blocks_of = [-(-ctx // BLOCK) for _, ctx in seqs]
    ids = list(range(sum(blocks_of)))
    gen.shuffle(ids)
    width = max(blocks_of)
    tables, at = [], 0
    for n in blocks_of:
        tables.append(ids[at:at + n] + [0] * (width - n))
        at += n
    num_tokens = sum(n for n, _ in seqs)
    k_cache = torch.randn(len(ids), BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device="cuda")  # noqa: E731
    meta = PagedAttentionMetadata(
        slot_mapping=as_long([0] * num_tokens), query_start_loc=as_long(starts),
        context_lens=as_long([ctx for _, ctx in seqs]), block_tables=as_long(tables),
        max_query_len=max(n for n, _ in seqs), max_context_len=max(ctx for _, ctx in seqs))
    return q, k_cache, v_cache, meta


def attention_rows(base_attention, report: dict) -> None:
    """Attention of three steps: eight fresh 1,024-token chunks; a step of the workload's prefill phase (chunks of
    prompts of 100-1,024 tokens up to 8,192, some behind a cached prefix, with 128 decodes); a decode step of 256
    sequences half-way through the workload (contexts prompt + 256)."""
    from minirt.kernels import paged_attention_triton as this

    gen = random.Random(0)
    mixed, budget = [], 8192 - 128
    while budget > 0:
        n = min(budget, gen.randint(100, 1024))
        mixed.append((n, n + (gen.randint(0, 512) if gen.random() < 0.2 else 0)))
        budget -= n
    mixed += [(1, gen.randint(100, 1024) + 5) for _ in range(128)]
    steps = {"eight 1024-token chunks": [(1024, 1024)] * 8, "workload prefill step": mixed,
             "256 decodes, contexts prompt + 256": [(1, gen.randint(100, 1024) + 256) for _ in range(256)]}
    for label, seqs in steps.items():
        q, k_cache, v_cache, meta = attention_step(seqs, 1)
        row = {"step": label, "tokens": q.shape[0], "sequences": len(seqs),
               # causal: new token i of a chunk of n sees ctx - n + i + 1 keys; QK^T and PV, 2 FLOPs a multiply-add
               "chunk_flop": sum(4 * HEADS * HEAD_DIM * (n * (ctx - n) + n * (n + 1) // 2) for n, ctx in seqs if n > 1),
               "kv_bytes": sum(2 * ctx * KV_HEADS * HEAD_DIM * 2 for _, ctx in seqs)}
        want = base_attention.paged_attention_triton(q, k_cache, v_cache, meta)
        variants = {"base": lambda: base_attention.paged_attention_triton(q, k_cache, v_cache, meta),
                    "this": lambda: this.paged_attention_triton(q, k_cache, v_cache, meta)}
        reps = 4
        if meta.max_query_len > 1:
            for rows, tile in ((128, (64, 8, 3)), (128, (128, 8, 3)), (128, (64, 4, 3)), (128, (32, 4, 3)),
                               (128, (32, 4, 2)), (128, (32, 4, 4)), (128, (32, 8, 3)), (128, (16, 4, 3)),
                               (64, (64, 4, 3)), (64, (32, 4, 3)), (64, (32, 2, 3)), (256, (64, 8, 3)),
                               (256, (32, 8, 3)), (256, (32, 8, 2))):
                variants[f"this m{rows} " + "x".join(map(str, tile))] = (
                    lambda r=rows, t=tile: this.paged_attention_triton(q, k_cache, v_cache, meta, chunk_tile=t,
                                                                       chunk_block_m=r))
        for name, call in variants.items():
            try:
                got = call()
            except Exception as e:                  # a tiling that does not fit (shared memory, registers)
                row[name + " error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            row[name + " us"] = us([call] * reps)
            row[name + " max diff"] = max_diff(got, want)
        report["attention"].append(row)
        print(f"attention {label}: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith(" us")))


@torch.inference_mode()
def main(argv=None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--base",), {"required": True, "help": "folder with minirt/"}),
                            out_dir=str(REPO / "lab" / "results" / "prefill-kernels"))
    if args is None:
        return 2
    torch.manual_seed(0)
    from minirt.fast.ops import fused

    report = {**report_header(torch.device("cuda")), "base": args.base, "silu_and_mul": [], "rotary": [],
              "attention": []}
    silu_rows(fused, report)
    rotary_rows(load_base(args.base, "rotary_triton"), report)
    attention_rows(load_base(args.base, "paged_attention_triton"), report)
    write_report(report, args.out, f"prefill-kernels-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
