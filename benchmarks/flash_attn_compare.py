"""minirt's Triton paged-attention kernel against flash-attn's, over the same paged KV cache (CUDA, bf16).

Qwen3-0.6B's attention layout: 16 query heads, 8 KV heads, head_dim 128, 16-token blocks scattered over a
shuffled pool (random block tables). Decode: batches of 1 to 256 sequences at 818 to 4096 tokens of context. Prefill: one
chunk of 128 to 4096 new tokens, with no cached prefix and after a 2048-token cached prefix. Each kernel is timed
two ways: `eager`, `triton.testing.do_bench` of one call from Python (launch included, as an eager step pays it
per layer), and `graph`, the GPU time per call of 20 calls captured in one CUDA graph (no launch cost). Kernels:
minirt's `paged_attention_triton` with its split-KV heuristic (the baseline: ratios are other / minirt) and
without split-KV (num_splits=1), and flash-attn with its defaults (flash-attn-4: num_splits=1) and with its
split heuristic (num_splits=0; flash-attn-4 refuses it on Hopper, which the JSON records as an error). Each
output's max abs error against float32 `paged_attention_reference` is stored too. Writes
`flash-attn-compare-cuda-<date>.json` to --out, with the commit measured (--commit, else `git rev-parse`).

    python benchmarks/flash_attn_compare.py [--quick] [--commit SHA]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minirt.attention import PagedAttentionMetadata, paged_attention_reference  # noqa: E402
from minirt.bench import commit as source_commit, environment, write_report  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
DECODE = [(1, 818), (1, 4096), (32, 818), (64, 818), (256, 818), (256, 2048)]          # (batch, context)
PREFILL = [(n, p) for p in (0, 2048) for n in (128, 256, 512, 1024, 2048, 4096)]        # (new tokens, cached)
GRAPH_CALLS = 20


def make_case(q_lens: list[int], ctx_lens: list[int], seed: int):
    """q, the K/V cache of one layer and the metadata: each sequence's blocks drawn from a shuffled pool."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-c // BLOCK) for c in ctx_lens]
    pool = list(range(sum(blocks) + 8))
    rng.shuffle(pool)
    k_cache = torch.randn(len(pool), BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = [[pool.pop() for _ in range(b)] for b in blocks]
    width = max(blocks)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long, device="cuda"),   # not read by attention
        query_start_loc=torch.tensor(starts, device="cuda"), context_lens=torch.tensor(ctx_lens, device="cuda"),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda"),
        max_query_len=max(q_lens), max_context_len=max(ctx_lens))
    return q, k_cache, v_cache, meta


def graph_us(fn) -> float:
    """GPU microseconds per call of `fn`, GRAPH_CALLS calls captured in one CUDA graph (median of 5 replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return sorted(times)[2]


def measure(kind: str, shape: tuple[int, int], kernels: dict, seed: int) -> dict:
    from triton.testing import do_bench

    if kind == "decode":
        batch, ctx = shape
        q_lens, ctx_lens = [1] * batch, [ctx] * batch
    else:
        new, cached = shape
        q_lens, ctx_lens = [new], [new + cached]
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, seed)
    want = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta)
    kv_bytes = 2 * sum(ctx_lens) * KV_HEADS * HEAD_DIM * 2
    row = {"kind": kind, "shape": list(shape), "q_lens_total": sum(q_lens), "kv_bytes": kv_bytes, "kernels": {}}
    for name, (prepare, run) in kernels.items():
        prepared = prepare(meta)
        fn = lambda: run(q, k_cache, v_cache, prepared)           # noqa: E731
        try:
            err = (fn().float() - want).abs().max().item()
        except Exception as e:                                     # e.g. a split count the package refuses
            row["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        eager = do_bench(fn, warmup=25, rep=100) * 1e3
        row["kernels"][name] = {"eager_us": eager, "graph_us": graph_us(fn), "max_abs_err": err}
    base = row["kernels"]["minirt"]
    for name, r in row["kernels"].items():
        if "error" in r:
            continue
        r["eager_ratio"] = r["eager_us"] / base["eager_us"]
        r["graph_ratio"] = r["graph_us"] / base["graph_us"]
        r["kv_tb_per_s_graph"] = kv_bytes / r["graph_us"] / 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two decode and two prefill shapes")
    ap.add_argument("--commit", default=None, help="the commit measured (default: the checkout's, or MINIRT_COMMIT)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: the comparison needs a CUDA device", file=sys.stderr)
        return 2
    from minirt.fast.flash_attn import flash_attn_api, FlashAttnPagedAttention
    from minirt.kernels.paged_attention_triton import paged_attention_triton

    api_name, module = flash_attn_api()
    if api_name is None:
        print(f"error: flash-attn is not importable ({module})", file=sys.stderr)
        return 2
    commit = args.commit or source_commit()
    fa_default, fa_split = FlashAttnPagedAttention(api_name, module), FlashAttnPagedAttention(api_name, module, 0)
    kernels = {"minirt": (lambda m: m, lambda q, k, v, m: paged_attention_triton(q, k, v, m)),
               "minirt num_splits=1": (lambda m: m, lambda q, k, v, m: paged_attention_triton(q, k, v, m, num_splits=1)),
               f"{api_name}": (fa_default.prepare, fa_default.run),
               f"{api_name} num_splits=0": (fa_split.prepare, fa_split.run)}
    decode, prefill = (DECODE[:2], PREFILL[2:4]) if args.quick else (DECODE, PREFILL)
    rows = []
    print(f"{torch.cuda.get_device_name()}; {api_name}; bf16; {HEADS} q heads, {KV_HEADS} KV heads, head_dim "
          f"{HEAD_DIM}, {BLOCK}-token blocks. us per call: eager (launch included) / CUDA graph; ratio to minirt")
    for kind, shapes in (("decode", decode), ("prefill", prefill)):
        for i, shape in enumerate(shapes):
            row = measure(kind, shape, kernels, seed=i)
            rows.append(row)
            label = (f"decode {shape[0]} x {shape[1]}" if kind == "decode"
                     else f"prefill {shape[0]} new after {shape[1]} cached")
            cells = "  ".join(f"{n}: {r['error'][:60]}" if "error" in r else
                              f"{n}: {r['eager_us']:7.1f} / {r['graph_us']:7.1f} us (x{r['graph_ratio']:.2f}, "
                              f"err {r['max_abs_err']:.3f})" for n, r in row["kernels"].items())
            print(f"{label:34s} {cells}", flush=True)
    dev, versions = environment(torch.device("cuda"))
    report = {"device": dev, "versions": versions, "commit": commit, "date": datetime.datetime.now().isoformat(),
              "layout": {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
                         "dtype": "bfloat16"},
              "flash_attn": api_name, "baseline": "minirt", "graph_calls": GRAPH_CALLS, "rows": rows}
    write_report(report, args.out, f"flash-attn-compare-cuda{'-quick' if args.quick else ''}-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
