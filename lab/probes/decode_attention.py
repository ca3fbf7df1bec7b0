"""The batch-1 attention side in CUDA graphs: the CUDA decode attention kernel (one kernel, thread block clusters
combining the splits) against the Triton path's three kernels (rotation with the K/V write, split-KV attention, the
combine), between the GEMVs around them.

    python lab/probes/decode_attention.py [--context 640] [--layers 28] [--out lab/results/decode-attention-cuda]

Qwen3-0.6B's shapes in bf16 (16 query heads, 8 KV heads, head dim 128, hidden 1024), one sequence of `--context`
keys. Each variant is captured as one CUDA graph of `--layers` layers, each layer's own weights and K/V cache:
`chain` runs q/k/v GEMV -> attention side -> o_proj GEMV per layer (the kernels with PDL, as in the engine),
`alone` the attention side only, layer after layer. Variants: the Triton path; the CUDA kernel at 16, 8, 4 and 2
blocks per cluster; and at 16 with parts left out (`-skipN`: 1 the cluster's combine, each block writing its own
partial output; 2 the q/k norm and rotation; 3 both; 5 and 7 as 1 and 3, launched without clusters; their outputs
are wrong, the timing is the point); `-nopdl` launches the CUDA kernel without PDL. The graphs replay in
interleaved rounds; the table gives µs per layer
(median over rounds) and the ratio to the Triton path. Also records how many clusters of each size fit at once
(`cudaOccupancyMaxActiveClusters`). Writes `decode-attention-cuda-<date>.json` (lab/pages/decode-attention-cuda.md
reads it). Needs a Hopper GPU and nvcc.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]            # minirt and lab; overlap_probe
from minirt.bench import report_header, write_report  # noqa: E402
from overlap_probe import graph  # noqa: E402
from minirt.metrics import format_table  # noqa: E402

H, HKV, D, HIDDEN, BLOCK = 16, 8, 128, 1024, 16


def layer_inputs(context: int, device, gen):
    """One layer's weights, cache and step inputs (the new token at position context - 1)."""
    bf16 = torch.bfloat16
    blocks = -(-context // BLOCK) + 1
    tables = torch.randperm(blocks, generator=gen)[None, :blocks - 1].to(device)
    pos = context - 1
    return dict(
        w_qkv=(torch.randn(H * D + 2 * HKV * D, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(bf16).to(device),
        w_o=(torch.randn(HIDDEN, H * D, generator=gen) * (H * D) ** -0.5).to(bf16).to(device),
        k_cache=torch.randn(blocks, BLOCK, HKV, D, generator=gen).to(bf16).to(device),
        v_cache=torch.randn(blocks, BLOCK, HKV, D, generator=gen).to(bf16).to(device),
        block_tables=tables, context_lens=torch.tensor([context], device=device),
        slot_mapping=(tables[0, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(1),
        query_start_loc=torch.tensor([0, 1], device=device),
        qkv=torch.randn(1, 1, H * D + 2 * HKV * D, generator=gen).to(bf16).to(device),   # the `alone` mode's input
        q_weight=(1 + 0.1 * torch.randn(D, generator=gen)).to(bf16).to(device),
        k_weight=(1 + 0.1 * torch.randn(D, generator=gen)).to(bf16).to(device))


def attention_side(variant: str, q, k, v, cos, sin, layer):
    """The variant's attention side for one layer: q/k/v `[1, 1, heads, D]` -> `[1, 1, H, D]`."""
    from minirt.attention import PagedAttentionMetadata
    from lab.kernels.decode_attention_cuda import decode_attention_cuda
    from minirt.kernels.paged_attention_triton import paged_attention_triton
    from minirt.kernels.rotary_triton import norm_rotate_and_store_triton

    if variant == "triton":
        q = norm_rotate_and_store_triton(q, k, v, cos, sin, layer["q_weight"], layer["k_weight"], 1e-6,
                                         layer["k_cache"], layer["v_cache"], layer["slot_mapping"], pdl=True)
        meta = PagedAttentionMetadata(slot_mapping=layer["slot_mapping"], query_start_loc=layer["query_start_loc"],
                                      context_lens=layer["context_lens"], block_tables=layer["block_tables"],
                                      max_query_len=1, max_context_len=int(layer["block_tables"].shape[1] * BLOCK))
        return paged_attention_triton(q[0], layer["k_cache"], layer["v_cache"], meta, pdl=True)[None]
    name, pdl = variant.removesuffix("-nopdl"), not variant.endswith("-nopdl")
    splits, _, skip = name.removeprefix("cuda-").partition("-skip")    # "cuda-16", "cuda-16-skip1", "cuda-8-nopdl"
    return decode_attention_cuda(q, k, v, cos, sin, layer["q_weight"], layer["k_weight"], 1e-6, layer["k_cache"],
                                 layer["v_cache"], layer["slot_mapping"], layer["block_tables"], layer["context_lens"],
                                 num_splits=int(splits), pdl=pdl, skip=int(skip or 0))


def capture(variant: str, mode: str, layers, x, cos, sin):
    from minirt.kernels.gemv_triton import linear_gemv

    sizes = [H * D, HKV * D, HKV * D]

    def forward():
        h = x
        for layer in layers:
            qkv = linear_gemv(h, layer["w_qkv"], pdl=True) if mode == "chain" else layer["qkv"]
            q, k, v = qkv.split(sizes, dim=-1)
            out = attention_side(variant, q.view(1, 1, H, D), k.view(1, 1, HKV, D), v.view(1, 1, HKV, D), cos, sin,
                                 layer)
            h = linear_gemv(out.view(1, 1, H * D), layer["w_o"], pdl=True) if mode == "chain" else h
        return h

    return graph(forward)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default="triton,cuda-16,cuda-8,cuda-4,cuda-2,cuda-16-skip1,cuda-16-skip2,"
                        "cuda-16-skip3,cuda-16-nopdl")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=os.path.join(ROOT, "lab", "results", "decode-attention-cuda"))
    args = parser.parse_args(argv)
    from lab.kernels.decode_attention_cuda import decode_attention_missing, library

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if missing := decode_attention_missing(device, torch.bfloat16, D, H // HKV, D):
        print(f"decode_attention.py needs {'; '.join(missing)}", file=sys.stderr)
        return 2
    variants = args.variants.split(",")
    bad = [v for v in variants if v != "triton" and not re.fullmatch(r"cuda-(1|2|4|8|16)(-skip[12357])?(-nopdl)?", v)]
    if bad:
        print(f"--variants: {bad} are not triton or cuda-SPLITS[-skipN][-nopdl]", file=sys.stderr)
        return 2

    gen = torch.Generator().manual_seed(0)
    layers = [layer_inputs(args.context, device, gen) for _ in range(args.layers)]
    x = torch.randn(1, 1, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    angles = (args.context - 1) * 1e6 ** (-torch.arange(0, D, 2).double() / D)
    cos = torch.cat([angles.cos()] * 2)[None, None].to(torch.bfloat16).to(device)
    sin = torch.cat([angles.sin()] * 2)[None, None].to(torch.bfloat16).to(device)
    graphs = {(v, m): capture(v, m, layers, x, cos, sin) for v in variants for m in ("chain", "alone")}
    times = {key: [] for key in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.rounds):
        keys = list(graphs) if r % 2 == 0 else list(graphs)[::-1]
        for key in keys:
            graphs[key].replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(20):
                graphs[key].replay()
            end.record()
            torch.cuda.synchronize()
            times[key].append(start.elapsed_time(end) * 1e3 / 20 / args.layers)      # µs per layer
    rows, results = [], {}
    base = {m: statistics.median(times[("triton", m)]) for m in ("chain", "alone")} if "triton" in variants else None
    for (v, m), ts in times.items():
        med = statistics.median(ts)
        results[f"{v}/{m}"] = {"us_per_layer": ts, "median": med}
        rows.append([v, m, f"{med:.3f}", f"{med / base[m]:.3f}" if base else "-"])
    lib = library("BF16", D, H // HKV)
    clusters = {size: lib.minirt_decode_attention_max_clusters(size) for size in (2, 4, 8, 16)}
    print(format_table(["variant", "mode", "us/layer", "x triton"], rows))
    print("clusters that fit at once, by size:", clusters)
    report = {**report_header(device), "workload": {"context": args.context, "layers": args.layers,
                                                    "rounds": args.rounds}, "results": results,
              "max_active_clusters": clusters}
    name = f"decode-attention-cuda-{datetime.date.today()}{'-' + args.label if args.label else ''}"
    write_report(report, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
