"""The GEMMs of a decode burst at 128 and 256 rows: cuBLAS (`F.linear`) against a plain Triton `tl.dot` kernel.

    python lab/probes/decode_gemms.py [--out lab/results/kernel-choices-and-tiles]

At 256 sequences a decode step spends about 0.9 ms in cuBLAS's GEMMs (`lab/pages/throughput-ceiling.md`: 28
layers x q/k/v, o_proj, gate/up and down_proj, plus the LM head), about half the bf16 GEMM rate for their FLOPs; the N = 1024 products
(o_proj, down_proj) have only 16-32 output tiles of 128 x 64 for 132 SMs. Before writing a fused GEMM for the
engine, this measures what a plain Triton kernel reaches at those shapes, with split-K (several programs share
one output tile's K, then a second kernel sums their float32 partials; CUTLASS's and Triton's split-K) for the
narrow ones. Each shape runs as a decode step runs it: 28 calls on 28 different weights (more than the L2 holds)
captured in one CUDA graph; us per call, the median of the replays. Every Triton variant is checked against a
float32 product of the same bf16 inputs (max relative error in the JSON), as cuBLAS is. Writes
`decode-gemms-cuda-<date>.json` with the commit. Needs CUDA.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from harness import cuda_graph_seconds, cuda_script_args  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402

LAYERS = 28
SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072),
          "lm_head": (151936, 1024)}                                        # (N, K): W is [N, K]
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
    (64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1),
    (64, 64, 128, 4, 3, 1), (64, 64, 64, 4, 4, 2), (64, 64, 64, 4, 4, 4), (128, 64, 64, 4, 4, 2),
    (64, 128, 64, 4, 4, 2), (32, 64, 128, 4, 3, 4),
]


@triton.jit
def _matmul_kernel(X, W, Out, Part, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T with float32 accumulation; with SPLIT_K > 1, program k of SPLIT_K sums one
    contiguous share of K into Part[k, M, N] (float32) instead."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * share
    k_hi = tl.minimum(K, k_lo + share)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < k_hi)[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn < N)[:, None] & (rk < k_hi)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], acc.to(Out.dtype.element_ty), mask=ok)
    else:
        tl.store(Part + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)


@triton.jit
def _sum_splits_kernel(Part, Out, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_k Part[k, m, n], rounded once to out's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(SPLIT_K):
        acc += tl.load(Part + k * M * N + i, mask=ok, other=0.0)
    tl.store(Out + (i // N) * stride_om + i % N, acc.to(Out.dtype.element_ty), mask=ok)


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple, out: torch.Tensor | None = None,
                  part: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` @ w `[N, K]`^T -> `[M, N]` in x's dtype, with one of CONFIGS (part: the float32 `[SPLIT_K, M, N]`
    workspace of a split-K config, allocated here when not given)."""
    bm, bn, bk, warps, stages, split_k = config
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if split_k > 1 and part is None:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _matmul_kernel[grid](x, w, out, part if split_k > 1 else out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](part, out, m, n, out.stride(0), SPLIT_K=split_k, BLOCK=1024)
    return out


def graph_us(calls) -> float:
    """us per call: `calls` (a list of LAYERS callables) captured in one CUDA graph, the median of 15 replays."""
    return cuda_graph_seconds(lambda: [call() for call in calls]) * 1e6 / len(calls)


def relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.float() @ w.float().T
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@torch.inference_mode()
def main(argv=None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, out_dir=str(REPO / "lab" / "results" / "kernel-choices-and-tiles"))
    if args is None:
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    report = {**report_header(dev), "layers": LAYERS, "rows": []}
    for name, (n, k) in SHAPES.items():
        copies = 1 if name == "lm_head" else LAYERS                  # the LM head runs once per step
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (128, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            row = {"shape": name, "m": m, "n": n, "k": k}
            row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in weights])     # as the engine calls it
            row["cublas_err"] = relative_error(F.linear(x, weights[0]), x, weights[0])
            for config in CONFIGS:
                key = "triton " + "x".join(map(str, config))
                part = torch.empty(config[5], m, n, dtype=torch.float32, device=dev) if config[5] > 1 else None
                try:
                    row[key + " err"] = relative_error(triton_linear(x, weights[0], config, out, part), x, weights[0])
                    row[key] = graph_us([lambda w=w: triton_linear(x, w, config, out, part) for w in weights])
                except triton.runtime.errors.OutOfResources as e:
                    row[key] = f"out of resources: {e}"[:120]
            timed = {key: v for key, v in row.items() if key.startswith("triton") and isinstance(v, float)
                     and not key.endswith("err")}
            best = min(timed, key=timed.get)
            row["best_triton"], row["best_triton_us"] = best, timed[best]
            report["rows"].append(row)
            print(f"{name:13s} M={m:3d} N={n:6d} K={k:4d}: cuBLAS {row['cublas_us']:7.2f} us "
                  f"({flops / row['cublas_us'] / 1e6:5.0f} TFLOP/s), best Triton {timed[best]:7.2f} us "
                  f"({timed[best] / row['cublas_us']:.3f}x) {best}")
    for m in (128, 256):
        rows = [r for r in report["rows"] if r["m"] == m]
        calls = {r["shape"]: 1 if r["shape"] == "lm_head" else LAYERS for r in rows}      # per decode step
        report[f"step_ms_m{m}"] = step = {
            "cublas": sum(r["cublas_us"] * calls[r["shape"]] for r in rows) / 1e3,
            "best_triton_per_shape": sum(r["best_triton_us"] * calls[r["shape"]] for r in rows) / 1e3,
            "best_of_both": sum(min(r["cublas_us"], r["best_triton_us"]) * calls[r["shape"]] for r in rows) / 1e3}
        print(f"M={m}: a decode step's GEMMs, ms: {step}")
    write_report(report, args.out, f"decode-gemms-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
