"""Tried and dropped (2026-12-01): can a 256-sequence decode step overlap its memory-bound attention with its
compute-bound GEMMs by running two 128-sequence halves at once (NanoFlow's nano-batches, two-batch overlap)?

    python lab/probes/overlap_probe.py [--out lab/results/two-streams]

On the bench's random Qwen3-0.6B-shaped model, in CUDA graphs (ms per graph): (a) the 28 layers' decode attention at
128 sequences (contexts of 818 tokens, the throughput workload's mean) and the 28 layers' four GEMMs at M = 128, each
alone, one after the other, and on two streams at once; two attention graphs over different sequences likewise;
(b) the engine's whole decode forward at 256 sequences against two 128-sequence forwards, one after the other and on
two streams at once. If two streams beat one after the other by little, the GPU does not run the two kinds of work
side by side, and splitting the batch cannot pay (the figures: `lab/pages/two-streams.md`).
Writes `overlap-probe-cuda-<date>.json` with the commit. Needs CUDA.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
import minirt  # noqa: E402
from harness import cuda_script_args, cuda_seconds  # noqa: E402
from minirt.attention import PagedAttentionMetadata  # noqa: E402
from minirt.bench import build_random_qwen3, report_header, write_report  # noqa: E402
from minirt.fast.cuda_graphs import DecodeGraphs  # noqa: E402

CONTEXT, BLOCK = 818, 16


def timed(fn) -> float:
    """Median ms of `fn` over 20 calls (`minirt.bench.cuda_seconds`)."""
    return cuda_seconds(fn, 20) * 1e3


def side_by_side(f1, f2):
    """f1 and f2 on two streams at once, after the work before them and before the work after."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def run():
        current = torch.cuda.current_stream()
        s1.wait_stream(current)
        s2.wait_stream(current)
        with torch.cuda.stream(s1):
            f1()
        with torch.cuda.stream(s2):
            f2()
        current.wait_stream(s1)
        current.wait_stream(s2)
    return run


def graph(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@torch.inference_mode()
def main(argv=None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, out_dir=str(REPO / "lab" / "results" / "two-streams"))
    if args is None:
        return 2
    dev = torch.device("cuda")
    report = report_header(dev)
    keep = []                                           # every tensor a graph reads stays alive
    with tempfile.TemporaryDirectory() as tmp:
        llm = minirt.LLM(build_random_qwen3(tmp, dev, 0), device=dev, dtype=torch.bfloat16)
        runner = llm.engine.model_runner
        model, kv, kernel, store = runner.model, runner.kv_cache, runner.kernel, runner.store
        cfg = model.config
        blocks = -(-(CONTEXT + 1) // BLOCK)

        def meta_for(first: int, n: int) -> PagedAttentionMetadata:
            tables = torch.arange(first * blocks, (first + n) * blocks, device=dev).view(n, blocks)
            return PagedAttentionMetadata(
                slot_mapping=tables[:, CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK,
                query_start_loc=torch.arange(n + 1, device=dev), context_lens=torch.full((n,), CONTEXT + 1, device=dev),
                block_tables=tables, max_query_len=1, max_context_len=CONTEXT + 1)

        def attention_graph(first: int, n: int) -> torch.cuda.CUDAGraph:
            meta = meta_for(first, n)
            q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
            keep.append((meta, q))
            layers = range(cfg.num_hidden_layers)
            return graph(lambda: [kernel(q, kv[layer][0], kv[layer][1], meta) for layer in layers])

        def gemm_graph(n: int) -> torch.cuda.CUDAGraph:
            x = torch.randn(n, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
            shapes = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))          # q/k/v, o, gate/up, down
            weights = [[torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for s in shapes]
                       for _ in range(cfg.num_hidden_layers)]
            keep.append((x, weights))

            def chain():
                h = x
                for qkv, o, gate_up, down in weights:
                    h = F.linear(F.linear(F.linear(F.linear(h, qkv)[:, :2048], o), gate_up)[:, :3072], down)
            return graph(chain)

        for n in (128, 256):
            report[f"attention_{n}_ms"] = timed(attention_graph(0, n).replay)
            report[f"gemms_{n}_ms"] = timed(gemm_graph(n).replay)
        attn, attn_other, gemms = attention_graph(0, 128), attention_graph(128, 128), gemm_graph(128)
        report["attention_128_then_gemms_128_ms"] = timed(lambda: (attn.replay(), gemms.replay()))
        report["attention_128_and_gemms_128_at_once_ms"] = timed(side_by_side(attn.replay, gemms.replay))
        report["attention_128_then_attention_128_ms"] = timed(lambda: (attn.replay(), attn_other.replay()))
        report["attention_128_and_attention_128_at_once_ms"] = timed(side_by_side(attn.replay, attn_other.replay))
        whole = runner.decode_graphs
        meta = meta_for(0, 256)
        lists = ([1] * 256, [CONTEXT] * 256, meta.slot_mapping.tolist(), [CONTEXT + 1] * 256,
                 meta.block_tables.tolist())
        whole.run(*lists)
        report["forward_256_ms"] = timed(lambda: whole.replay(256))
        halves = []
        for h in range(2):
            half = DecodeGraphs(model, kv, kernel, store, 128, whole.max_blocks_per_seq, whole.scratch_block,
                                capture=False)
            half.sizes = [128]
            half.capture()
            half.run(*(x[128 * h:128 * (h + 1)] for x in lists))
            halves.append(half)
        report["forward_128_ms"] = timed(lambda: halves[0].replay(128))
        report["forward_128_then_128_ms"] = timed(lambda: (halves[0].replay(128), halves[1].replay(128)))
        report["forward_128_and_128_at_once_ms"] = timed(side_by_side(lambda: halves[0].replay(128),
                                                                      lambda: halves[1].replay(128)))
    for key, value in report.items():
        if key.endswith("_ms"):
            print(f"{key:45s} {value:8.3f}")
    write_report(report, args.out, f"overlap-probe-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
