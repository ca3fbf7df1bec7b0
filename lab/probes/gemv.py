"""M = 1 matrix-vector products in bf16 on CUDA: F.linear (cuBLAS) against minirt's Triton `linear_gemv`.

For each shape: eager time (CUDA events over ITERS calls after warm-up), time inside a captured CUDA graph of
GRAPH_CALLS calls (no launch overhead), GB/s of weight reads, agreement with F.linear. Each shape cycles
through copies of W that together exceed the L2 (60 MB on an H200), so every call streams W from HBM as a
decode step does. Then a sweep of (block_n, block_k, split_k, num_warps) in the graph: the best per shape, the
best single config, and what `choose_config` picked. Last, the MLP's gate/up with its SiLU-and-multiply as two
kernels and as one (the product in the GEMV's epilogue). Writes `gemv-cuda[-quick]-<date>.json` to --out
(default `lab/results/gemv-chain`). `choose_config`'s defaults come from it; lab/pages/gemv-chain.md has the chains'.

    python lab/probes/gemv.py            # full sweep (a few minutes, mostly Triton compiles)
    python lab/probes/gemv.py --quick    # defaults and a handful of configs
    python lab/probes/gemv.py --chain    # a decode step's GEMVs back to back, with and without PDL
    python lab/probes/gemv.py --cuda-chain   # the same 28 layers in one persistent CUDA launch, against the above
    ncu --clock-control none --set full -k regex:gemv_chain --launch-skip 2 --launch-count 1 -o chain \
        python lab/probes/gemv.py --cuda-chain-launches 3      # that launch's stall reasons, for Nsight Compute

`--chain` measures what a batch-1 decode step runs: 28 layers' four GEMVs (q/k/v and gate/up with the norm in
their prologue, o_proj, down_proj; the gate/up with SiLU-and-multiply), each taking the one before's output as
its x, all with their own weights (0.88 GB, more than the L2), captured in one CUDA graph. Isolated calls
overstate each kernel's ramp-up and tail, which a chain with programmatic dependent launch (PDL) overlaps.
It times the chain with `choose_config`'s tiles without and with PDL, then each layer's four GEMVs as one
persistent launch (`lab.kernels.gemv_chain_triton`) at 1, 2, 4 and 8 programs per SM, then varies one layer
GEMV's tiles at a time (the others at their defaults), with PDL. Writes `gemv-chain-cuda-<date>.json`.

`--cuda-chain` times `lab.kernels.gemv_chain_cuda` (all 28 layers in one launch, the weights streamed through a
shared-memory ring by a producer warp) against the four-kernel chain with PDL and the persistent Triton chain (4
programs per SM, PDL) in the same run: both chains' outputs against float64 after 1 to 28 layers; stages of 8 and 16
KB, the ring as deep as shared memory allows and shallower, the weights' copies asking L2 to evict them first, and
the weight stream alone; per-block timelines (the SM clock at each part of each product: wait, input, first stage,
stages, epilogue; how far ahead the producer issued); and the time with one part left out at a time. Writes
`gemv-chain-cuda-kernel-<date>.json`. (`chain_inputs()` draws x from its own seeded generator too, so that every
call returns the same inputs.)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: minirt and lab
from minirt.bench import copy_bandwidth, report_header, write_report  # noqa: E402

G = None        # minirt.kernels.gemv_triton, imported in main() once CUDA (and so Triton) is known to be there

SHAPES = [(1024, 4096), (1024, 6144), (2048, 1024), (3072, 1024), (1024, 151936)]   # (K, N)
ITERS, GRAPH_CALLS, REPLAYS, REPEATS = 200, 50, 4, 5
ROTATE_BYTES = 256 << 20
DTYPE = torch.bfloat16


def candidates(quick: bool) -> list[G.GemvConfig]:
    if quick:
        return [G.GemvConfig(1, 1024, 1, 4), G.GemvConfig(2, 2048, 1, 4), G.GemvConfig(4, 1024, 1, 4),
                G.GemvConfig(8, 512, 1, 4), G.GemvConfig(4, 512, 2, 4), G.GemvConfig(16, 1024, 1, 8)]
    out = []
    for bn, bk, sk, nw in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (1, 2, 4), (2, 4, 8)):
        per_thread = bn * bk // (32 * nw)
        if 8 <= per_thread <= 64:          # >= one 16-byte load per thread, and no register spills
            out.append(G.GemvConfig(bn, bk, sk, nw))
    return out


def fits(cfg: G.GemvConfig, k: int) -> bool:
    """Skip configs that waste the shape: a chunk much wider than K, or split-K shares with no chunk."""
    return cfg.block_k <= max(16, 1 << (k - 1).bit_length()) and cfg.split_k * cfg.block_k <= max(k, cfg.block_k)


def ev():
    return torch.cuda.Event(enable_timing=True)


def time_eager(fn, x, ws) -> float:
    for i in range(20):
        fn(x, ws[i % len(ws)])
    torch.cuda.synchronize()
    s, e = ev(), ev()
    s.record()
    for i in range(ITERS):
        fn(x, ws[i % len(ws)])
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / ITERS


def time_graph(fn, x, ws) -> float:
    fn(x, ws[0])                                       # compile / cuBLAS handle outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(GRAPH_CALLS):
            fn(x, ws[i % len(ws)])
    us = replay_time(g, GRAPH_CALLS)
    del g
    return us


def replay_time(g: torch.cuda.CUDAGraph, calls: int) -> float:
    """Microseconds per call of a captured graph of `calls` calls: median of REPEATS timings of REPLAYS replays."""
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        s, e = ev(), ev()
        s.record()
        for _ in range(REPLAYS):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (REPLAYS * calls))
    return statistics.median(times)


def rel_diff(x, w, cfg=None) -> float:
    out = G.linear_gemv(x, w, config=cfg).float()
    ref = F.linear(x.double(), w.double())
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def silu_and_mul_epilogue(k: int = 1024, n: int = 6144) -> dict[str, float]:
    """The MLP's merged gate/up projection W `[n, k]` and its SiLU-and-multiply, in the graph: cuBLAS or the GEMV
    kernel followed by the compiled elementwise kernel (what `fused_ops` runs), against the GEMV kernel with the
    product in its epilogue (`linear_gemv(silu_and_mul=True)`). Microseconds per pair, and the fused result's
    largest error against the float64 reference relative to the largest output."""
    from minirt.fast.ops import fused
    from minirt.model.layers import silu_and_mul

    act = fused(silu_and_mul)
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
          for _ in range(max(1, math.ceil(ROTATE_BYTES / (n * k * DTYPE.itemsize))))]
    x = torch.randn(1, k, device="cuda", dtype=DTYPE)
    gate, up = F.linear(x.double(), ws[0].double()).chunk(2, -1)
    ref = F.silu(gate) * up
    diff = ((G.linear_gemv(x, ws[0], silu_and_mul=True).double() - ref).abs().max() / ref.abs().max()).item()
    return {"max |fused - float64 reference| / max |reference|": diff,
            "cuBLAS + compiled silu_and_mul": time_graph(lambda x_, w_: act(*F.linear(x_, w_).chunk(2, -1)), x, ws),
            "GEMV kernel + compiled silu_and_mul": time_graph(
                lambda x_, w_: act(*G.linear_gemv(x_, w_).chunk(2, -1)), x, ws),
            "GEMV kernel, SiLU-and-multiply in its epilogue": time_graph(
                lambda x_, w_: G.linear_gemv(x_, w_, silu_and_mul=True), x, ws)}


#: The four GEMVs of a Qwen3-0.6B layer as (name, K, N, what the call fuses): N counts the rows of W.
LAYER = [("qkv_proj + input norm", 1024, 4096, "norm"), ("o_proj", 2048, 1024, ""),
         ("gate_up_proj + norm + SiLU", 1024, 6144, "norm,silu"), ("down_proj", 3072, 1024, "")]
NUM_LAYERS = 28
HIDDEN, N_QKV, K_O, INTER = LAYER[0][1], LAYER[0][2], LAYER[1][1], LAYER[3][1]   # the chain's shapes, from LAYER


def chain_candidates(n: int, fuses: str) -> list:
    """Tiles to try for one layer GEMV in the chain: split-K only for plain calls (the fused ones never split)."""
    tiles = [(1, 1024, 4), (1, 2048, 4), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4),
             (4, 1024, 8), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8)]
    out = [G.GemvConfig(bn, bk, 1, nw) for bn, bk, nw in tiles]
    if not fuses:
        out += [G.GemvConfig(1, 1024, 2, 4), G.GemvConfig(2, 512, 2, 4), G.GemvConfig(4, 512, 2, 4)]
    return out


def chain_inputs():
    """NUM_LAYERS layers' weights (LAYER's shapes, each layer its own), a norm weight and the first x: seeded."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [[torch.randn(n, k, device="cuda", dtype=DTYPE, generator=gen) / k ** 0.5 for _, k, n, _ in LAYER]
               for _ in range(NUM_LAYERS)]
    x = torch.randn(1, 1024, device="cuda", dtype=DTYPE, generator=gen)
    return weights, torch.ones(1024, device="cuda", dtype=DTYPE), x


def us_per_layer(step) -> float:
    """`step` (NUM_LAYERS layers) run once, captured in a CUDA graph and replayed: microseconds per layer."""
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    us = replay_time(g, NUM_LAYERS)
    del g
    return us


def layer_chain(pdl: bool, configs: dict | None = None) -> float:
    """Microseconds per layer of NUM_LAYERS layers' GEMVs replayed from one CUDA graph (see the module docstring).
    configs: {index in LAYER: GemvConfig} overriding `choose_config` for that GEMV in every layer."""
    configs = configs or {}
    weights, norm_w, x0 = chain_inputs()

    def step():
        x, stream = x0, None
        for ws in weights:
            qkv, stream = G.linear_gemv(x, ws[0], config=configs.get(0), norm_weight=norm_w, residual=stream, pdl=pdl)
            o = G.linear_gemv(qkv[:, :K_O], ws[1], config=configs.get(1), pdl=pdl)
            act, stream = G.linear_gemv(o, ws[2], config=configs.get(2), silu_and_mul=True, norm_weight=norm_w,
                                        residual=stream, pdl=pdl)
            x = G.linear_gemv(act, ws[3], config=configs.get(3), pdl=pdl)
        return x

    return us_per_layer(step)


def persistent_chain(pdl: bool, programs_per_sm: int) -> float:
    """`layer_chain`'s layers with each layer's four GEMVs in one persistent launch (`gemv_chain`, phases split by
    grid barriers; one memset zeroes the layers' counts), microseconds per layer."""
    from lab.kernels.gemv_chain_triton import gemv_chain

    weights, norm_w, x0 = chain_inputs()
    sync = torch.zeros(NUM_LAYERS, dtype=torch.int32, device="cuda")

    def step():
        x, stream = x0, None
        sync.zero_()
        for i, ws in enumerate(weights):
            outs = gemv_chain(x, ws, (norm_w, norm_w), stream, sync=sync[i:i + 1], programs_per_sm=programs_per_sm,
                              pdl=pdl)
            x, stream = outs.out, outs.stream_mlp
        return x

    return us_per_layer(step)


def cuda_chain_inputs():
    """`chain_inputs()` as `gemv_chain_layers` takes them: (layers, their `layer_table`, x)."""
    from lab.kernels.gemv_chain_cuda import layer_table

    weights, norm_w, x0 = chain_inputs()
    layers = [(*ws, norm_w, norm_w) for ws in weights]
    return layers, layer_table(layers), x0


def cuda_chain(num_stages: int | None = None, skip: int = 0, stage_bytes: int = 16384,
               weights_evict_first: bool = False) -> tuple[float, torch.Tensor]:
    """`layer_chain`'s layers in one persistent CUDA launch (`gemv_chain_layers`, which zeroes its sync buffer in
    the graph too): microseconds per layer, and the last layer's output. skip: the kernel's SKIP_* bits (a part
    left out); weights_evict_first: the weights' copies ask L2 to evict them first."""
    from lab.kernels.gemv_chain_cuda import gemv_chain_layers, sync_buffer

    layers, table, x0 = cuda_chain_inputs()
    sync = sync_buffer(x0.device, HIDDEN, N_QKV, INTER)
    outs = []

    def step():
        outs.append(gemv_chain_layers(x0, layers, table=table, sync=sync, num_stages=num_stages, skip=skip,
                                      stage_bytes=stage_bytes, weights_evict_first=weights_evict_first).out)
        return outs[-1]

    return us_per_layer(step), outs[-1].clone()


def layer_chain_output(num_layers: int = NUM_LAYERS) -> torch.Tensor:
    """The four-kernel chain's output for the first num_layers layers of `chain_inputs()` (eager, PDL off)."""
    weights, norm_w, x = chain_inputs()
    stream = None
    for ws in weights[:num_layers]:
        qkv, stream = G.linear_gemv(x, ws[0], norm_weight=norm_w, residual=stream)
        o = G.linear_gemv(qkv[:, :K_O], ws[1])
        act, stream = G.linear_gemv(o, ws[2], silu_and_mul=True, norm_weight=norm_w, residual=stream)
        x = G.linear_gemv(act, ws[3])
    return x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def chain_depth_agreement() -> dict:
    """Both chains' outputs against `reference_chain` (float64, rounded where they round) after 1 to NUM_LAYERS
    layers of `chain_inputs()`, eager: how the bf16 rounding steps add up with depth."""
    from lab.kernels.gemv_chain_cuda import gemv_chain_layers, reference_chain

    layers, _, x0 = cuda_chain_inputs()
    out = {}
    for depth in (1, 2, 4, 8, 16, NUM_LAYERS):
        ref = reference_chain(x0, layers[:depth]).out
        cuda, four = gemv_chain_layers(x0, layers[:depth]).out, layer_chain_output(depth)
        out[depth] = {"cuda_vs_float64": rel(cuda, ref), "four_kernels_vs_float64": rel(four, ref),
                      "cuda_vs_four_kernels": rel(cuda, four)}
        print(f"  {depth:2d} layers: CUDA chain {out[depth]['cuda_vs_float64']:.1e} from float64, four kernels "
              f"{out[depth]['four_kernels_vs_float64']:.1e}, each other {out[depth]['cuda_vs_four_kernels']:.1e}",
              flush=True)
    return out


def chain_timeline(skip: int = 0) -> dict:
    """One eager launch of the 28-layer CUDA chain with its timeline on: per product, the median over blocks and
    layers 2-27 of each part of a block's time (thread 0's clock between TIMELINE_STAMPS), in microseconds at the
    clock rate the launch's own duration gives; and how far ahead of the consumers the producer issued (None with
    SKIP_STREAM: no copies)."""
    from lab.kernels.gemv_chain_cuda import TIMELINE_STAMPS, gemv_chain_layers

    layers, table, x0 = cuda_chain_inputs()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    timeline = torch.zeros(grid, 4 * NUM_LAYERS, len(TIMELINE_STAMPS), dtype=torch.int64, device="cuda")
    for _ in range(3):                                     # warm: the library, the weights' first touch
        gemv_chain_layers(x0, layers, table=table, skip=skip, timeline=timeline)
    s, e = ev(), ev()
    s.record()
    gemv_chain_layers(x0, layers, table=table, skip=skip, timeline=timeline)
    e.record()
    e.synchronize()
    t = timeline.cpu().double()
    cycles = (t[:, -1, 5] - t[:, 0, 0]).median().item()
    ghz = cycles / (s.elapsed_time(e) * 1e6)
    us = lambda d: (d / (ghz * 1e3)).median().item()  # noqa: E731
    idx = {name: i for i, name in enumerate(TIMELINE_STAMPS)}
    parts = [("wait", "start", "waited"), ("input", "waited", "input loaded"),
             ("first stage", "input loaded", "first stage"), ("stages", "first stage", "stages done"),
             ("epilogue", "stages done", "epilogue done")]
    out = {"clock_ghz": ghz, "launch_us": s.elapsed_time(e) * 1e3, "products": {}}
    names = ["qkv", "o_proj", "gate_up", "down"]
    for p in range(4):
        rows = t[:, [4 * layer + p for layer in range(1, NUM_LAYERS)], :]
        row = {name: us(rows[..., idx[b]] - rows[..., idx[a]]) for name, a, b in parts}
        issued = rows[..., idx["first copy issued"]]
        row["producer lead"] = us(rows[..., idx["start"]] - issued) if (issued > 0).all() else None
        out["products"][names[p]] = row
    print(f"  timeline{', skip ' + str(skip) if skip else ''}: launch {out['launch_us']:.0f} us, "
          f"clock {ghz:.2f} GHz; per product, median us:", flush=True)
    for name, row in out["products"].items():
        print("    " + f"{name:8s} " + ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in row.items()),
              flush=True)
    return out


def cuda_chain_sweep(out_dir: str) -> None:
    from lab.kernels import gemv_chain_cuda as C
    from lab.kernels.gemv_chain_cuda import cuda_chain_missing, max_stages

    device = torch.device("cuda")
    if missing := cuda_chain_missing(device):
        print(f"the CUDA chain needs {' and '.join(missing)}", file=sys.stderr)
        return
    layer_bytes = sum(k * n for _, k, n, _ in LAYER) * DTYPE.itemsize
    bandwidth = copy_bandwidth(device, 1 << 30)
    ideal = layer_bytes / bandwidth["bytes_per_s"] * 1e6
    report = {"layer_bytes": layer_bytes, "bandwidth": bandwidth, "ideal_us_per_layer": ideal}
    print(f"weights per layer {layer_bytes / 1e6:.1f} MB: {ideal:.2f} us at the copy bandwidth", flush=True)
    report["four_kernels_pdl_us"] = layer_chain(True)
    print(f"four kernels per layer, PDL: {report['four_kernels_pdl_us']:.2f} us per layer", flush=True)
    report["triton_persistent_4_per_sm_pdl_us"] = persistent_chain(True, 4)
    print(f"persistent Triton chain, 4 per SM, PDL: {report['triton_persistent_4_per_sm_pdl_us']:.2f} us per layer")
    print("agreement by depth (relative L2 distance of the last output):")
    report["depth_agreement"] = chain_depth_agreement()
    want = layer_chain_output()
    report["cuda_chain"] = {}
    for stage_bytes in (8192, 16384):
        most = max_stages(device, HIDDEN, K_O, INTER, stage_bytes)
        for stages in sorted({most, most // 2, 8 * 16384 // stage_bytes, 4}):   # as deep as fits, and shallower
            us, out = cuda_chain(stages, 0, stage_bytes)
            err = rel(out, want)
            report["cuda_chain"][f"{stage_bytes} x {stages}"] = {
                "us_per_layer": us, "rel_err_vs_four_kernels": err, "fraction_of_copy_bandwidth": ideal / us}
            print(f"CUDA chain, {stages} stages of {stage_bytes} bytes: {us:.2f} us per layer "
                  f"({ideal / us:.0%} of the copy bandwidth), output vs the four kernels: {err:.1e}", flush=True)
        us, _ = cuda_chain(None, C.SKIP_BARRIERS | C.SKIP_PROLOGUE | C.SKIP_DOTS, stage_bytes)
        report["cuda_chain"][f"{stage_bytes}, weight stream alone"] = {"us_per_layer": us}
        print(f"  stages of {stage_bytes} bytes, the weight stream alone: {us:.2f} us per layer "
              f"({ideal / us:.0%})", flush=True)
    us, out = cuda_chain(weights_evict_first=True)      # the weights' copies ask L2 to evict them first
    report["cuda_chain"]["16384, weights evicted first"] = {
        "us_per_layer": us, "rel_err_vs_four_kernels": rel(out, want), "fraction_of_copy_bandwidth": ideal / us}
    print(f"CUDA chain, the weights evicted first from L2: {us:.2f} us per layer", flush=True)
    # What each part costs: the same launch with a part left out (its results are wrong then).
    parts = {"no waits": C.SKIP_BARRIERS, "no input loads": C.SKIP_PROLOGUE, "no dot products": C.SKIP_DOTS,
             "no weight stream (waits, loads, epilogues)": C.SKIP_STREAM,
             "waits and epilogues alone": C.SKIP_STREAM | C.SKIP_PROLOGUE}
    report["timeline"] = {f"skip {skip}": chain_timeline(skip) for skip in (0, C.SKIP_STREAM)}
    report["breakdown"] = {}
    for name, skip in parts.items():
        us, _ = cuda_chain(None, skip)
        report["breakdown"][name] = us
        print(f"  {name}: {us:.2f} us per layer", flush=True)
    write_report({**report_header(device), **report}, out_dir, f"gemv-chain-cuda-kernel-{datetime.date.today()}")


def chain_sweep(out_dir: str) -> None:
    from minirt.kernels import pdl_missing

    device = torch.device("cuda")
    layer_bytes = sum(k * n for _, k, n, _ in LAYER) * DTYPE.itemsize
    bandwidth = copy_bandwidth(device, 1 << 30)
    ideal = layer_bytes / bandwidth["bytes_per_s"] * 1e6         # bytes_per_s counts a copy's reads and writes
    report = {"layer_bytes": layer_bytes, "bandwidth": bandwidth, "ideal_us_per_layer": ideal}
    report["default_no_pdl_us"] = layer_chain(False)
    print(f"weights per layer {layer_bytes / 1e6:.1f} MB: {ideal:.2f} us at the copy bandwidth")
    print(f"default tiles, no PDL: {report['default_no_pdl_us']:.2f} us per layer")
    missing = pdl_missing(device)
    if missing:
        print(f"PDL needs {missing}: the rest of the sweep is skipped")
        report["pdl_missing"] = missing
    else:
        report["default_pdl_us"] = base = layer_chain(True)
        print(f"default tiles, PDL:    {base:.2f} us per layer")
        report["persistent"] = {}
        for per_sm in (1, 2, 4, 8):                       # one launch per layer, phases split by grid barriers
            for pdl in (False, True):
                key = f"{per_sm} per SM, pdl={pdl}"
                report["persistent"][key] = us = persistent_chain(pdl, per_sm)
                print(f"persistent chain, {key}: {us:.2f} us per layer", flush=True)
        report["one_at_a_time"] = {}
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        for i, (name, k, n, fuses) in enumerate(LAYER):
            rows_n = n // 2 if "silu" in fuses else n
            default = G.choose_config(rows_n, k, sm_count, split_k=not fuses)
            results = []
            for cfg in chain_candidates(rows_n, fuses):
                if not fits(cfg, k):
                    continue
                try:
                    results.append((layer_chain(True, {i: cfg}), tuple(cfg)))
                except Exception as err:           # e.g. out of resources for a large tile
                    print(f"  {name} {tuple(cfg)}: {type(err).__name__}: {str(err)[:100]}")
            results.sort()
            report["one_at_a_time"][name] = {"default": tuple(default), "results": results}
            print(f"{name}: default {tuple(default)}; fastest "
                  + ", ".join(f"{cfg} {us:.2f}" for us, cfg in results[:4]), flush=True)
    write_report({**report_header(device), **report}, out_dir,
                 f"gemv-chain-cuda-{datetime.date.today()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--chain", action="store_true", help="a decode step's GEMV chain, with and without PDL")
    ap.add_argument("--cuda-chain", action="store_true", help="the chain in one persistent CUDA launch")
    ap.add_argument("--cuda-chain-launches", type=int, metavar="N",
                    help="only launch the CUDA chain N times, eagerly, for a profiler (ncu) to pick one")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "gemv-chain"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: the GEMV benchmark needs a CUDA device", file=sys.stderr)
        return 2
    global G
    from minirt.kernels import gemv_triton as G
    import triton
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")

    if args.chain:
        chain_sweep(args.out)
        return 0
    if args.cuda_chain:
        cuda_chain_sweep(args.out)
        return 0
    if args.cuda_chain_launches:
        from lab.kernels.gemv_chain_cuda import gemv_chain_layers

        layers, table, x0 = cuda_chain_inputs()
        for _ in range(args.cuda_chain_launches):
            gemv_chain_layers(x0, layers, table=table)
        torch.cuda.synchronize()
        return 0
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device, 1 << 30)                # the bench's HBM yardstick: a 1 GiB copy
    print(f"device copy: {bandwidth['bytes_per_s'] / 1e9:.0f} GB/s (read + write)")

    cands = candidates(args.quick)
    torch.manual_seed(0)
    rows, sweep = [], {}
    for k, n in SHAPES:
        wbytes = n * k * DTYPE.itemsize
        copies = max(1, math.ceil(ROTATE_BYTES / wbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        default = G.choose_config(n, k, props.multi_processor_count)
        row = dict(shape=f"[1,{k}]x[{n},{k}]^T", MB=wbytes / 1e6, default=tuple(default),
                   cublas_eager=time_eager(F.linear, x, ws), gemv_eager=time_eager(G.linear_gemv, x, ws),
                   cublas_graph=time_graph(F.linear, x, ws), gemv_graph=time_graph(G.linear_gemv, x, ws),
                   diff=rel_diff(x, ws[0]))
        t0 = time.time()
        results = []
        for cfg in cands:
            if not fits(cfg, k):
                continue
            try:
                d = rel_diff(x, ws[0], cfg)
                us = time_graph(lambda x_, w_, c=cfg: G.linear_gemv(x_, w_, config=c), x, ws)
            except Exception as err:                   # e.g. out of resources for a large tile
                print(f"  {tuple(cfg)}: {type(err).__name__}: {str(err)[:120]}")
                continue
            results.append((us, tuple(cfg), d))
        results.sort()
        sweep[row["shape"]] = results
        row["best"], row["best_graph"] = (results[0][1], results[0][0]) if results else (None, float("nan"))
        rows.append(row)
        print(f"{row['shape']}: swept {len(results)} configs in {time.time() - t0:.0f} s; fastest:", flush=True)
        for us, cfg, d in results[:5]:
            print(f"    {cfg}  {us:6.2f} us  {wbytes / us / 1e3:6.0f} GB/s  diff {d:.1e}")
        bad = [(cfg, d) for _, cfg, d in results if not d <= 1e-2]
        if bad:
            print(f"    DISAGREE with F.linear: {bad}")
        del ws

    print("\n(us per call; GB/s = weight bytes / time; 'graph' = inside a CUDA graph of "
          f"{GRAPH_CALLS} calls; default = choose_config; diff = max|gemv - ref| / max|ref|)")
    hdr = (f"{'shape':24} {'MB':>6} | {'eager cuBLAS':>12} {'gemv':>6} | {'graph cuBLAS':>12} {'GB/s':>5} | "
           f"{'gemv dflt':>9} {'GB/s':>5} | {'gemv best':>9} {'GB/s':>5} {'best config (bn,bk,sk,nw)':>26} | "
           f"{'default config':>20} {'diff':>7}")
    print(hdr)
    for r in rows:
        def gbs(us, mb=r["MB"]):
            return mb * 1e6 / us / 1e3
        print(f"{r['shape']:24} {r['MB']:6.1f} | {r['cublas_eager']:12.2f} {r['gemv_eager']:6.2f} | "
              f"{r['cublas_graph']:12.2f} {gbs(r['cublas_graph']):5.0f} | {r['gemv_graph']:9.2f} "
              f"{gbs(r['gemv_graph']):5.0f} | {r['best_graph']:9.2f} {gbs(r['best_graph']):5.0f} "
              f"{str(r['best']):>26} | {str(r['default']):>20} {r['diff']:7.1e}")

    # One config for all shapes: the smallest geometric mean of (its time / the shape's best time).
    per_shape = [{cfg: us for us, cfg, _ in res} for res in sweep.values() if res]
    common = set.intersection(*(set(d) for d in per_shape)) if per_shape else set()
    score = {cfg: math.exp(statistics.mean(math.log(d[cfg] / min(d.values())) for d in per_shape)) for cfg in common}
    print("\nbest single configs across all shapes (geometric-mean slowdown against each shape's best):")
    for cfg, sc in sorted(score.items(), key=lambda kv: kv[1])[:8]:
        print(f"    {cfg}  x{sc:.3f}   " + "  ".join(f"{d[cfg]:.2f}" for d in per_shape))

    epilogue = silu_and_mul_epilogue()
    print("\ngate/up at batch 1, then SiLU-and-multiply, inside a CUDA graph (us per pair):")
    for name, value in epilogue.items():
        print(f"    {value:6.2f} us  {name}" if name.startswith(("cuBLAS", "GEMV")) else f"    {value:.1e}  {name}")

    report = dict(**report_header(device), bandwidth=bandwidth, rows=rows, silu_and_mul=epilogue,
                  sweep={shape: [dict(us=us, config=cfg, diff=d) for us, cfg, d in res] for shape, res in sweep.items()})
    write_report(report, args.out, f"gemv-cuda{'-quick' if args.quick else ''}-{datetime.date.today()}")


if __name__ == "__main__":
    sys.exit(main())
