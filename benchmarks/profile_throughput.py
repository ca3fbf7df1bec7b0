"""Where the throughput workload's time goes, on a GPU: step by step, kernel by kernel, against its ceiling.

    python benchmarks/profile_throughput.py [--quick] [--no-sweep] [--out benchmarks/results]

One `minirt.LLM` with its defaults on the bench's Qwen3-0.6B-shaped random checkpoint and the bench's throughput
workload (`minirt.bench.WORKLOADS`: 256 requests, prompts of 100-1024 tokens, 512 new each; `--quick` 32 x 64).

1. The machine: copy bandwidth (`minirt.bench.copy_bandwidth`, read + write), read bandwidth (`torch.sum` over
   4 GiB) and the bf16 GEMM rate of a prefill-sized product; from them the workload's ceiling: every decode step
   reads the weights and every sequence's K/V once, every prompt token costs 2 x parameters FLOPs.
2. A timed run, each model-runner call recorded (host clock, CUDA events, no sync added): time in steps with
   prefill chunks, in decode bursts (multi-step decode), and between calls (the host's own work); for single steps
   also the GPU time until their inputs were queued and of their forward; the garbage collector's pauses.
3. A profiled run of the same workload: `torch.profiler` switched on for a few steps with prefill chunks, the first
   engine step of bursts and a few more at the full batch; kernels by category and the top kernels, per phase.
4. (`--no-sweep` leaves it out) The paged-attention kernel's tile options at the two shapes that dominate: a decode
   batch of all the workload's sequences half-way through (contexts = prompt + 256) and one step of eight 1024-token
   prefill chunks; every variant's output checked against the default's.

Writes `profile-throughput-cuda[-quick]-<date>.json` with the commit measured. Needs CUDA.
"""

from __future__ import annotations

import collections
import datetime
import functools
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import minirt
from minirt.bench import (WORKLOADS, build_random_qwen3, copy_bandwidth, make_prompts, report_header, run_minirt,
                          write_report)
from harness import SETTINGS_OPTION, cuda_script_args, cuda_seconds, script_settings

CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("attention", ("_paged_attention_kernel", "_combine_splits")),
    ("rotary + K/V write", ("rotate", "rotary", "_store_kv")),
    ("gemv", ("gemv",)),
    ("gemm (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "sm90")),
    ("torch.compile fused", ("triton_",)),
    ("sampling / argmax", ("argmax", "reduce_kernel", "max_kernel")),
    ("copies", ("memcpy", "Memcpy", "copy", "CatArray")),
    ("indexing", ("index", "gather", "scatter", "embedding")),
    ("elementwise", ("elementwise", "fill", "add", "mul")),
]


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def read_seconds(device, nbytes: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return cuda_seconds(x.sum)


def gemm_seconds(device, m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    return cuda_seconds(functools.partial(torch.matmul, a, w.t()))


def machine(device) -> dict:
    copy = copy_bandwidth(device, 2**31)
    read_s = read_seconds(device, 2**32)                                 # 4 GiB
    gemm_s = gemm_seconds(device, 8192, 1024, 6144)      # the merged gate/up at one full step's tokens
    torch.cuda.empty_cache()
    return {"copy": copy, "read_bytes_per_s": 2**32 / read_s, "gemm_flop_per_s": 2 * 8192 * 1024 * 6144 / gemm_s}


def ceiling(prompts: list[list[int]], n: int, weight_bytes: int, params: int, kv_bytes_per_token: int,
            bw: float, flops: float) -> dict:
    """Seconds the workload needs at the bandwidth `bw` and FLOP rate `flops`: n decode steps that each read the
    weights and every sequence's K/V (context = prompt + step), plus the prompts' FLOPs (2 x params a token)."""
    kv = sum(kv_bytes_per_token * (len(p) + s) for p in prompts for s in range(n))
    decode_s = (n * weight_bytes + kv) / bw
    prefill_s = 2 * params * sum(len(p) for p in prompts) / flops
    total = decode_s + prefill_s
    return {"decode_s": decode_s, "prefill_s": prefill_s, "total_s": total,
            "output_tokens_per_s": len(prompts) * n / total, "kv_bytes_read": kv}


class Recorder:
    """Wraps an engine's step function (and its runner's `execute`, to tell steps apart) to record each engine step:
    kind ("prefill": with prompt chunks, "decode": a single decode step, "burst": multi-step decode), rows, tokens,
    decode steps run, host start and end. `windows` maps an engine step's index to (label, count): a
    `torch.profiler` session (CUDA kernels) over that many engine steps from there."""

    def __init__(self, engine):
        self.engine, self.calls, self.windows = engine, [], {}
        self.profiles: dict[str, list] = collections.defaultdict(list)
        runner = engine.model_runner
        self._step, self._execute, self._forward = engine.step_fn, runner.execute, runner.forward
        engine.step_fn, runner.execute, runner.forward = self.step, self.execute, self.forward
        self._launch = getattr(runner, "launch_step", None)        # async scheduling's steps (the fast runner)
        if self._launch is not None:
            runner.launch_step = self.launch_step
        self._staging = getattr(runner, "staging", None)
        if self._staging is not None:
            self._send = self._staging.send
            self._staging.send = self.send
        self._sent = None          # CUDA event recorded once a single step's inputs are queued for the device
        self._seen = None
        self._launched = None      # host seconds from the single step's start until its forward was launched
        self._open = None          # (label, first index, last index, engine.num_steps at the start, profiler)

    def close(self):
        runner = self.engine.model_runner
        self.engine.step_fn, runner.execute, runner.forward = self._step, self._execute, self._forward
        if self._launch is not None:
            runner.launch_step = self._launch
        if self._staging is not None:
            self._staging.send = self._send

    def send(self, step):
        """The fast runner's input copy (`InputStaging.send`): an event after it, where the GPU can start."""
        out = self._send(step)
        self._sent = torch.cuda.Event(enable_timing=True)
        self._sent.record()
        return out

    def execute(self, items):
        """A single step (prefill chunks, or decodes that run no burst): its kind, and CUDA events around it."""
        return self._single(self._execute, items)

    def launch_step(self, items, previous=None):
        """A step launched by async scheduling (recorded under the engine step that launched it, whose host time
        is mostly spent taking the step before): as `execute`, its end event once its tokens are sampled."""
        return self._single(lambda it: self._launch(it, previous), items)

    def _single(self, run, items):
        self._seen = ("decode" if all(n == 1 for _, n in items) else "prefill", len(items), sum(n for _, n in items))
        self._exec_t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._sent = self._forwarded = None
        result = run(items)
        end.record()
        self._events = (start, end, self._sent, self._forwarded)
        return result

    def forward(self, step, fill=None):
        """The forward of a single step; the host's time until it returns (every kernel launched) is recorded, and
        an event after its last kernel."""
        hidden = self._forward(step) if fill is None else self._forward(step, fill)
        self._launched = time.perf_counter() - self._exec_t0
        self._forwarded = torch.cuda.Event(enable_timing=True)
        self._forwarded.record()
        return hidden

    def step(self):
        engine, index = self.engine, len(self.calls)
        if index in self.windows and self._open is None:
            label, count = self.windows[index]
            host_too = label in ("prefill", "first_burst")
            prof = profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_too else []))
            prof.start()
            self._open = (label, index, index + count - 1, engine.num_steps, prof)
        self._seen, self._launched, self._events = None, None, None
        before, rows = engine.num_steps, len(engine.scheduler.running_requests)
        t0 = time.perf_counter()
        result = self._step()
        t1 = time.perf_counter()
        kind, rows, tokens = self._seen or ("burst", rows, rows)
        steps = engine.num_steps - before
        self.calls.append({"kind": kind, "rows": rows, "tokens": tokens, "steps": steps, "t0": t0, "t1": t1,
                           "launched_s": self._launched, "events": self._events})
        if self._open is not None and self._open[2] == index:
            label, first_index, _, first_step, prof = self._open
            torch.cuda.synchronize()
            prof.stop()
            host = sum(c["t1"] - c["t0"] for c in self.calls[first_index:])
            self.profiles[label].append((host, engine.num_steps - first_step, rows, prof))
            self._open = None
        return result


class GcPauses:
    """Records the garbage collector's collections while open (`gc.callbacks`): per generation, how many and how many
    seconds the host spent in them."""

    def __init__(self):
        self.count, self.seconds, self.longest_s, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0, None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = time.perf_counter() - self._t0
            gen = info["generation"]
            self.count[gen] += 1
            self.seconds[gen] += dt
            self.longest_s = max(self.longest_s, dt)

    def as_dict(self) -> dict:
        return {"collections": self.count, "seconds": self.seconds, "longest_s": self.longest_s,
                "total_s": sum(self.seconds)}


def step_records(calls: list[dict]) -> list[list]:
    """Every engine step as [kind, rows, tokens, decode steps, host ms, ms until the forward was launched (single
    steps), GPU ms between events around the runner's execute (single steps), and of that, GPU ms until the inputs
    were queued (the host preparing them, the GPU idle) and GPU ms of the forward (steps that copy their inputs
    with `InputStaging`)], in order. Synchronizes."""
    torch.cuda.synchronize()
    rows = []
    for c in calls:
        gpu = prep = forward = None
        if c.get("events"):
            start, end, sent, forwarded = c["events"]
            gpu = start.elapsed_time(end)
            if sent is not None and forwarded is not None:
                prep, forward = start.elapsed_time(sent), sent.elapsed_time(forwarded)
        launched = None if c.get("launched_s") is None else c["launched_s"] * 1e3
        rows.append([c["kind"], c["rows"], c["tokens"], c["steps"], (c["t1"] - c["t0"]) * 1e3, launched, gpu,
                     prep, forward])
    return rows


def summarize_calls(calls: list[dict], wall: float) -> dict:
    out = {}
    for kind in ("prefill", "decode", "burst"):
        mine = [c for c in calls if c["kind"] == kind]
        if not mine:
            continue
        out[kind] = {"calls": len(mine), "steps": sum(c["steps"] for c in mine),
                     "host_s": sum(c["t1"] - c["t0"] for c in mine), "tokens": sum(c["tokens"] * c["steps"] for c in mine)}
        if kind == "burst":
            full = [c for c in mine if c["rows"] == max(m["rows"] for m in mine) and c["steps"]]
            out[kind]["full_batch_rows"] = full[0]["rows"]
            out[kind]["full_batch_s_per_step"] = statistics.median((c["t1"] - c["t0"]) / c["steps"] for c in full)
    out["between_steps_s"] = wall - sum(c["t1"] - c["t0"] for c in calls)
    out["wall_s"] = wall
    return out


def windows_for(calls: list[dict]) -> dict:
    """Profiler windows for a run like the one `calls` records: its 3rd-5th steps with prefill chunks, one each,
    the first engine step of bursts (which took about twice as long as the next ones in the 2026-12-01 profiles), and
    three engine steps of bursts at the full batch from the middle one on."""
    prefill = [i for i, c in enumerate(calls) if c["kind"] == "prefill"][2:5]
    bursts = [i for i, c in enumerate(calls) if c["kind"] == "burst"
              and c["rows"] == max(c2["rows"] for c2 in calls if c2["kind"] == "burst")]
    windows = {i: ("prefill", 1) for i in prefill}
    if bursts:
        windows[bursts[0]] = ("first_burst", 1)
        windows[bursts[len(bursts) // 2]] = ("burst", 3)
    return windows


def cpu_table(prof, steps: int) -> list[dict]:
    """The host's top operations by self time (a profile with CPU activity), per step."""
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    return [{"name": e.key[:120], "self_cpu_us_per_step": e.self_cpu_time_total / steps, "calls_per_step": e.count / steps}
            for e in rows[:25]]


def kernel_table(prof, steps: int) -> dict:
    by_name = collections.Counter()
    count = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name] += e.time_range.elapsed_us()
            count[e.name] += 1
    by_cat = collections.Counter()
    for name, us in by_name.items():
        by_cat[category(name)] += us
    total = sum(by_name.values())
    return {"kernel_us_per_step": total / steps, "kernels_per_step": sum(count.values()) / steps,
            "by_category_us_per_step": {k: v / steps for k, v in by_cat.most_common()},
            "top": [{"name": n[:120], "category": category(n), "us_per_step": us / steps, "calls_per_step":
                     count[n] / steps} for n, us in by_name.most_common(15)]}


def attention_sweep(device, quick: bool) -> dict:
    """Tile options of `_paged_attention_kernel` at a decode batch and a prefill step (see the module docstring)."""
    import triton

    from minirt.attention import PagedAttentionMetadata
    from minirt.kernels.paged_attention_triton import _paged_attention_kernel

    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 16, 8, 128, 16
    n, (lo, hi), new = WORKLOADS["cuda", quick]["throughput"]
    prompts = make_prompts(n, (lo, hi), 100, 0)
    shapes = {"decode": ([len(p) + new // 2 for p in prompts], [1] * n),
              "decode-64": ([len(p) + new // 2 for p in prompts[:64]], [1] * min(n, 64)),
              "prefill": ([1024] * 8, [1024] * 8)}
    results = {}
    for shape, (ctx, qlen) in shapes.items():
        blocks = [-(-c // bs) for c in ctx]
        total = sum(blocks)
        k_cache = torch.randn(total + 1, bs, kv_heads, dim, dtype=torch.bfloat16, device=device)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(total, device=device)
        width = max(blocks)
        tables = torch.zeros(len(ctx), width, dtype=torch.long, device=device)
        start = 0
        for i, b in enumerate(blocks):
            tables[i, :b] = perm[start:start + b]
            start += b
        q = torch.randn(sum(qlen), heads, dim, dtype=torch.bfloat16, device=device)
        qsl = torch.tensor([0] + list(torch.tensor(qlen).cumsum(0)), device=device)
        meta = PagedAttentionMetadata(slot_mapping=None, query_start_loc=qsl,
                                      context_lens=torch.tensor(ctx, device=device), block_tables=tables,
                                      max_query_len=max(qlen), max_context_len=max(ctx))
        kv_bytes = sum(ctx) * kv_heads * dim * 2 * 2
        ref = None
        rows = []
        variants = [(16, 64, 4, 3)] + [(16, bn, w, s) for bn in (128, 256) for w in (2, 4, 8) for s in (1, 2, 3)]
        if shape == "prefill":
            variants = [(bm, bn, w, s) for bm in (16, 64, 128) for bn in (64, 32) for w in (4, 8) for s in (3, 2)]
        for bm, bn, warps, stages in variants:
            out = torch.empty_like(q)
            grid = (len(ctx), kv_heads, triton.cdiv(max(qlen), bm // (heads // kv_heads)))
            call = functools.partial(
                _paged_attention_kernel[grid],
                q, k_cache, v_cache, out, out, out, out, out, tables, meta.context_lens, qsl, dim ** -0.5,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                tables.stride(0), out.stride(0), out.stride(1),
                BLOCK_SIZE=bs, HEAD_DIM=dim, GROUP=heads // kv_heads, BLOCK_M=bm, BLOCK_N=bn, NUM_SPLITS=1,
                IEEE=False, PDL=False, PREFETCH=False, LAST_COMBINES=False, num_warps=warps, num_stages=stages)
            try:
                s = cuda_seconds(call, iters=20)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile (shared memory) is recorded
                rows.append({"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            rows.append({"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages, "us": s * 1e6,
                         "kv_bytes_per_s": kv_bytes / s, "max_abs_diff_vs_first": err})
        default = next(r for r in rows if r.get("block_n") == 64 and r.get("block_m") == 16 and "us" in r
                       and r["num_warps"] == 4 and r["num_stages"] == 3)
        ok = [r for r in rows if "us" in r]
        results[shape] = {"contexts_sum": sum(ctx), "query_tokens": sum(qlen), "kv_bytes": kv_bytes,
                          "default_like": default, "best": min(ok, key=lambda r: r["us"]), "variants": rows}
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (["--quick"], {"action": "store_true"}),
                            (["--no-sweep"], {"action": "store_true"}), SETTINGS_OPTION)
    settings = None if args is None else script_settings(args.settings)
    if settings is None:
        return 2
    device = torch.device("cuda")
    report = {**report_header(device), "quick": args.quick, "settings": settings}
    report["machine"] = m = machine(device)
    n_req, lengths, n = WORKLOADS["cuda", args.quick]["throughput"]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_qwen3(tmp, device, 0)
        llm = minirt.LLM(path, device=device, dtype=torch.bfloat16, **settings)
        engine = llm.engine
        cfg = engine.model.config
        params = sum(p.numel() for p in engine.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
        prompts = make_prompts(n_req, lengths, cfg.vocab_size, 0)          # the bench's seed for this workload
        report["plan"] = engine.plan.as_dict()
        report["ceiling"] = {
            "at_read_bandwidth": ceiling(prompts, n, weight_bytes, params, kv_per_token, m["read_bytes_per_s"],
                                         m["gemm_flop_per_s"]),
            "at_copy_bandwidth": ceiling(prompts, n, weight_bytes, params, kv_per_token, m["copy"]["bytes_per_s"],
                                         m["gemm_flop_per_s"])}
        run_minirt(llm, make_prompts(8, lengths, cfg.vocab_size, 101), 8, device)        # warm-up
        rec = Recorder(engine)
        with GcPauses() as pauses:
            figures, _ = run_minirt(llm, prompts, n, device)
        report["run"] = figures
        report["gc_during_run"] = pauses.as_dict()
        report["calls"] = summarize_calls(rec.calls, figures["wall_time_s"])
        report["steps"] = {"columns": ["kind", "rows", "tokens", "decode_steps", "host_ms", "launched_ms", "gpu_ms",
                                       "prep_gpu_ms", "forward_gpu_ms"],
                           "rows": step_records(rec.calls)}
        rec.windows, rec.calls = windows_for(rec.calls), []
        fresh = make_prompts(n_req, lengths, cfg.vocab_size, 7)    # new prompts: the first run's are now cached
        figures2, _ = run_minirt(llm, fresh, n, device)
        report["profiled_run_wall_s"] = figures2["wall_time_s"]
        report["profiles"] = {}
        for kind, sessions in rec.profiles.items():
            steps = sum(s[1] for s in sessions)
            merged = [kernel_table(p, st) | {"host_s_per_step": h / st, "rows": r} for h, st, r, p in sessions]
            if kind in ("prefill", "first_burst"):
                merged[0]["cpu_top"] = cpu_table(sessions[0][3], sessions[0][1])
            if kind == "prefill":
                trace = os.path.join(args.out, "profile-throughput-prefill-step-trace.json")
                sessions[0][3].export_chrome_trace(trace)
            report["profiles"][kind] = {"steps": steps, "sessions": merged}
        rec.close()
        del llm, engine
        torch.cuda.empty_cache()
    if not args.no_sweep:
        report["attention_sweep"] = attention_sweep(device, args.quick)
    name = f"profile-throughput-cuda{'-quick' if args.quick else ''}-{datetime.date.today()}"
    path = write_report(report, args.out, name)
    print_report(report)
    print(f"wrote {path}")
    return 0


def print_report(r: dict) -> None:
    m, c, run = r["machine"], r["ceiling"]["at_read_bandwidth"], r["run"]
    print(f"copy {m['copy']['bytes_per_s'] / 1e12:.2f} TB/s, read {m['read_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"GEMM {m['gemm_flop_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"ceiling (read bw): decode {c['decode_s']:.2f} s + prefill {c['prefill_s']:.2f} s = {c['total_s']:.2f} s "
          f"-> {c['output_tokens_per_s']:,.0f} tok/s; run: {run['wall_time_s']:.2f} s, "
          f"{run['output_tokens_per_s']:,.0f} tok/s = {run['output_tokens_per_s'] / c['output_tokens_per_s']:.1%}")
    if "gc_during_run" in r:
        g = r["gc_during_run"]
        print(f"  garbage collector during the run: {g['collections']} collections (generations 0/1/2), "
              f"{g['total_s'] * 1e3:.1f} ms in all, longest {g['longest_s'] * 1e3:.1f} ms")
    for kind, v in r["calls"].items():
        print(f"  {kind}: {v}")
    prefill = [row for row in r.get("steps", {}).get("rows", []) if row[0] == "prefill"]
    if prefill:
        med = lambda i: statistics.median(row[i] for row in prefill)          # noqa: E731
        print(f"  prefill steps, median: host {med(4):.1f} ms, forward launched after {med(5):.1f} ms, "
              f"GPU {med(6):.1f} ms; tokens {med(2):.0f}, rows {med(1):.0f}")
        if all(len(row) > 8 and row[7] is not None for row in prefill):
            print(f"    of the GPU time: until the inputs were queued {med(7):.1f} ms, the forward {med(8):.1f} ms")
    for kind, prof in r.get("profiles", {}).items():
        for s in prof["sessions"]:
            print(f"profile {kind} rows={s['rows']}: host {s['host_s_per_step'] * 1e3:.2f} ms/step, kernels "
                  f"{s['kernel_us_per_step'] / 1e3:.2f} ms/step, {s['kernels_per_step']:.0f} kernels/step")
            for cat, us in s["by_category_us_per_step"].items():
                print(f"    {cat:24s} {us / 1e3:8.3f} ms")
            for t in s["top"][:8]:
                print(f"      {t['us_per_step']:9.1f} us x{t['calls_per_step']:.0f}  {t['name'][:90]}")
    for shape, sw in r.get("attention_sweep", {}).items():
        d, b = sw["default_like"], sw["best"]
        print(f"attention {shape}: default-like {d['us']:.1f} us ({d['kv_bytes_per_s'] / 1e12:.2f} TB/s), best "
              f"{b['us']:.1f} us ({b['kv_bytes_per_s'] / 1e12:.2f} TB/s) at BLOCK_M={b['block_m']} "
              f"BLOCK_N={b['block_n']} warps={b['num_warps']} stages={b['num_stages']}")


if __name__ == "__main__":
    sys.exit(main())
