"""The quantized linears' products at decode and prefill row counts: which one `FastQuantizedLinear` should run.

    python lab/probes/quant_linears.py [--rows 1,2,4,8,16,32,64,128,256,1024,8192] [--gemm-configs]
        [--out lab/results/quantized-linears]

For each Qwen3-0.6B projection (merged q/k/v, o_proj, merged gate/up, down_proj) and each row count M, the products
`minirt.fast.quant_layers` can run, timed as a step runs them: 28 calls on 28 different weights (more than the L2
holds) captured in one CUDA graph; us per call, the median of the replays:

* bf16: `F.linear` on the float weights (cuBLAS), the unquantized baseline;
* quant_gemv (int8, fp8, fp8 with 128 x 128 blocks): the Triton GEMV that dequantizes in registers;
* quant_gemm (the same three): the Triton GEMM that converts the weight tiles in registers for `tl.dot`, with the
  config `choose_config` picks (recorded);
* dequantize (the same three): the reference's dequantize-then-GEMM (`dequantize_linear`);
* scaled_mm (fp8 per channel): dynamic per-token FP8 activations and `torch._scaled_mm` (`scaled_mm_linear`).

Each result carries its max error relative to the output's largest magnitude against the float64 product of the
dequantized weights (scaled_mm's includes the activations' e4m3 rounding). With --gemm-configs, quant_gemm also runs
each config of GEMM_CONFIGS with BLOCK_M at most twice the rows (at least 16), at every row count from 2 (variant
`quant_gemm/<format>`, each with its config and whether it is the chosen one): the sweep that sets
`quant_gemm_triton.TILES`. Writes quant-linears-cuda-<date>.json with the commit. Needs CUDA.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness
from harness import cuda_graph_seconds, cuda_script_args  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402
from minirt.fast.quant_layers import dequantize_linear, scaled_mm_linear  # noqa: E402
from minirt.kernels.quant_gemm_triton import QuantGemmConfig, choose_config, quant_gemm  # noqa: E402
from minirt.kernels.quant_gemv_triton import quant_gemv  # noqa: E402
from minirt.quant.formats import dequantize, quantize  # noqa: E402

LAYERS = 28
SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
FORMATS = {"int8": ("int8", None), "fp8": ("fp8", None), "fp8_block128": ("fp8", 128)}   # name: (method, block)
GEMV_MAX_ROWS = 64      # quant_gemv is timed up to here (it reloads the weights every 8 rows)
# --gemm-configs: (block_m, block_n, block_k, num_warps, num_stages); block_k divides 128 (the block-scaled format).
GEMM_CONFIGS = [QuantGemmConfig(*c) for c in (
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 64, 4, 5), (32, 64, 128, 4, 4),
    (32, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3))]


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv,
                            (("--rows",), {"default": "1,2,4,8,16,32,64,128,256,1024,8192"}),
                            (("--gemm-configs",), {"action": "store_true",
                                                   "help": "also time quant_gemm with each of GEMM_CONFIGS"}),
                            out_dir=str(REPO / "lab" / "results" / "quantized-linears"))
    if args is None:
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for shape_name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(LAYERS)]
        quantized = {f: [quantize(w, m, b) for w in weights] for f, (m, b) in FORMATS.items()}
        for m in rows:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            variants = [("bf16", {}, lambda: [F.linear(x, w) for w in weights])]     # (name, entry fields, calls)
            for f, (_, block) in FORMATS.items():
                qs = quantized[f]
                if m <= GEMV_MAX_ROWS:
                    variants.append((f"quant_gemv/{f}", {}, lambda qs=qs, block=block: [quant_gemv(x, q, s, block)
                                                                                          for q, s in qs]))
                variants.append((f"dequantize/{f}", {}, lambda qs=qs, block=block: [dequantize_linear(x, q, s, block)
                                                                                      for q, s in qs]))
                chosen = choose_config(m, n, k, block)
                # The sweep: tiles at most twice the rows (at least 16); larger ones only add padding.
                sweep = [c for c in GEMM_CONFIGS if c != chosen and c.block_m <= max(16, 2 * m)
                         and args.gemm_configs and m >= 2]
                for c in [chosen, *sweep]:
                    variants.append((f"quant_gemm/{f}", {"config": c._asdict(), "chosen": c == chosen},
                                     lambda qs=qs, block=block, c=c: [quant_gemm(x, q, s, block, config=c)
                                                                      for q, s in qs]))
            variants.append(("scaled_mm/fp8", {}, lambda qs=quantized["fp8"]: [scaled_mm_linear(x, q, s)
                                                                                for q, s in qs]))
            for name, fields, fn in variants:
                entry = {"shape": shape_name, "n": n, "k": k, "rows": m, "variant": name, **fields}
                try:
                    out = fn()[0]
                    fmt = name.split("/")[-1]
                    if fmt in FORMATS:
                        q, s = quantized[fmt][0]
                        ref = x.double() @ dequantize(q, s, FORMATS[fmt][1]).double().T
                    else:
                        ref = x.double() @ weights[0].double().T
                    entry["max_rel_error"] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    entry["us_per_call"] = cuda_graph_seconds(fn) / LAYERS * 1e6
                except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, not fatal
                    entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append(entry)
                print(entry, flush=True)
        del weights, quantized
        torch.cuda.empty_cache()
    report = {**report_header(device), "layers": LAYERS, "results": results}
    write_report(report, args.out, f"quant-linears-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
