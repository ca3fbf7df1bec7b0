"""What verifying k drafted tokens costs: one target step scoring k+1 tokens per request against one decode step.

    python benchmarks/spec_verify.py [--context 512] [--batches 1,8,32] [--ks 1,...,8] [--iters 30]
                                     [--acceptance benchmarks/results/cpu/spec-decode.json] [--out DIR]
    python benchmarks/spec_verify.py --device cpu --quick        # a smoke run on the CPU (a cut-down shape)

Speculative decoding pays off when the target's forward over k+1 tokens of one sequence costs about what a decode
step costs: at batch 1 a decode step reads every weight once for one row of arithmetic, so k more rows are nearly
free until the step stops being bound by memory bandwidth (the roofline of chapter 07). This script measures that
ratio on the engine's own runner: one `minirt.LLM` with speculation (the FastEngine's default plan: CUDA graphs for
decode steps, for verification steps and piecewise graphs for the others) on a Qwen3-0.6B-shaped checkpoint with
random bfloat16 weights (`minirt.bench.QWEN3_0_6B`), and for each batch size B and each k:

* k = 0: the plain decode step, B requests with one new token each (`runner.forward` + the greedy sampler), through
  the decode graphs;
* k >= 1: the verify step, B requests with k+1 new tokens each, every row's logits and argmax (what `greedy_accept`
  needs): `runner.forward_verify` (`SpeculativeSteps.verify`'s path for a step of running requests), which replays
  the verification graphs of k+1 rows per request (`minirt.fast.runner.build_verify_graphs`, captured here for each
  k at the capture sizes up to the largest batch), then the LM head and argmax; and for comparison the same step
  through `runner.forward`, the path it took before those graphs (the piecewise graphs, attention between the pieces);
* eager: the same steps with the engine's graphs set aside (decode, piecewise and verification), every kernel
  launched from Python, for the batches up to 8: the rows' cost alone, apart from what graphs save.

Every request has `--context` tokens in the KV cache before the step (their K/V are left as allocated: the time of
attention does not depend on the values). Timed with CUDA events after a warm-up (medians of `--iters`; on the CPU
`time.perf_counter`). Each verify step is also run once through both paths and their argmax compared (`agreement`,
the fraction of rows that agree: bfloat16 sums in another order may flip a near-tie, nothing more). Then the batch-1
speedup bound at the acceptance measured on the CPU (`--acceptance`, spec-decode.json): tokens per target step over
the step's cost in decode steps, E / (ratio_k + d_k), with E both the i.i.d. model's (1 - a^(k+1)) / (1 - a) at the
measured acceptance a and the tokens per target forward measured there, and d_k the cost of drafting k tokens in
batch-1 decode steps, measured here too: the n-gram lookup (`propose_ngram` on the host) and the shipped draft
model's `DraftModelProposer.propose` (its own eager runner and KV cache).

Writes `spec-verify.json` (with the commit measured) to `--out` (default benchmarks/results/h200, cpu-quick: none
unless --out is given). On the CPU (no CUDA graphs) the verification "graphs" run their padded static buffers
eagerly (`capture=False`), so that `--device cpu --quick` exercises every line the GPU run does.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import minirt  # noqa: E402
from minirt.bench import QWEN3_0_6B, report_header, write_report  # noqa: E402
from minirt.fast.runner import build_verify_graphs  # noqa: E402
from minirt.request import Request  # noqa: E402
from minirt.sampling import SamplingParams  # noqa: E402

KS = (1, 2, 3, 4, 5, 6, 7, 8)
BATCHES = (1, 8, 32)
EAGER_BATCHES = 8             # the eager steps (~20 ms each on the H200: host-bound) only up to this batch
EAGER_ITERS = 10
# --quick on the CPU: the same architecture, cut down so that a step takes milliseconds.
SMALL = {**QWEN3_0_6B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "vocab_size": 4096,
         "bos_token_id": 0, "eos_token_id": 0}


def build_checkpoint(path: str, config: dict, device: torch.device, seed: int = 0) -> str:
    """A Qwen3 checkpoint of `config` with random bfloat16 weights (built by transformers), saved to `path`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**config), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


class Timer:
    """Median seconds of `fn()` after `warmup` calls: CUDA events on a GPU, `time.perf_counter` on the CPU."""

    def __init__(self, device: torch.device, iters: int, warmup: int = 3):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        times.sort()
        return {"median_ms": statistics.median(times) * 1e3, "min_ms": times[0] * 1e3, "max_ms": times[-1] * 1e3}


def make_requests(llm, batch: int, context: int, new_tokens: int, seed: int) -> list[Request]:
    """`batch` requests of `context` computed tokens (random ids) and `new_tokens` tokens to score, each with its
    own blocks (disjoint ranges of the pool; nothing else runs on it)."""
    engine = llm.engine
    block_size, vocab = engine.config.block_size, engine.model.config.vocab_size
    per_request = -(-(context + new_tokens) // block_size)
    g = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(batch):
        ids = torch.randint(vocab, (context + new_tokens,), generator=g).tolist()
        r = Request(f"r{i}", None, ids, SamplingParams(max_new_tokens=1, ignore_eos=True), frozenset())
        r.block_table = list(range(i * per_request, (i + 1) * per_request))
        r.num_computed_tokens = context
        requests.append(r)
    return requests


def step_fns(runner, requests: list[Request], new_tokens: int, forward):
    """The step to time, twice: whole (the host builds its inputs, as each engine step does) and with the inputs
    built once beforehand (the forward, the logits and the argmax alone). A decode step (new_tokens 1: the runner's
    forward and sampler) or a verify step through `forward` (`runner.forward_verify` or `runner.forward`: every
    row's hidden state, the logits of all of them, their argmax, as `SpeculativeSteps.verify` takes them)."""
    items = [(r, new_tokens) for r in requests]

    def build():
        step = runner.prepare_lists(items)
        if new_tokens > 1:
            step.sample_rows = list(range(len(step.input_ids)))      # every drafted position and the one after
        return step

    def run(step):
        if new_tokens == 1:
            return runner.sample(runner.forward(step), step.sample_requests)
        return runner.model.compute_logits(forward(step)).argmax(dim=-1)

    built = build()
    return (torch.inference_mode()(lambda: run(build())), torch.inference_mode()(lambda: run(built)))


def engine_for(path: str, device: torch.device, dtype, batches, context: int, ks) -> "minirt.LLM":
    """The engine measured: speculation with the smallest k and verify_graphs asked for where CUDA graphs run
    (the graphs of the other k are built here), decode graphs up to the largest batch, a pool with room for every
    request plus one block (the CPU's stand-in for the scratch block) and a token budget that holds the largest verify
    step (piecewise graphs of up to 512 tokens or that step, as the default budget captures them up to there). On the
    CPU merged projections make the plan chapter 07's (`FastModelRunner`, eager), and max_model_len is cut to what
    the requests hold (the torch reference kernel of the padded static buffers attends over the tables' width)."""
    per_request = -(-(context + max(ks) + 1) // 16)
    cpu = {"verify_graphs": True} if device.type == "cuda" else {"merge_projections": True,
                                                                   "max_model_len": per_request * 16}
    return minirt.LLM(path, device=device, dtype=dtype, block_size=16, max_num_seqs=max(batches),
                      num_kv_blocks=max(batches) * per_request + 1, enable_prefix_caching=False,
                      max_num_batched_tokens=max(512, max(batches) * (max(ks) + 1)), speculative="ngram",
                      num_speculative_tokens=min(ks), **cpu)


def verify_graphs_for(llm, k: int, max_batch: int):
    """The verification graphs of k+1 rows per request at the capture sizes up to `max_batch` (the engine's own when
    they are those; captured only on CUDA), for the engine's plan with k drafted tokens, over its KV cache, their
    padding rows writing its last block (the scratch block on CUDA; on the CPU a pool block no request here holds)."""
    engine, runner = llm.engine, llm.engine.model_runner
    own = runner.verify_graphs
    if own is not None and own.query_len == k + 1 and own.sizes[-1] >= max_batch:
        return own
    plan = dataclasses.replace(engine.plan, num_speculative_tokens=k)
    return build_verify_graphs(plan, engine.model, runner.kv_cache, runner.kernel, runner.store, max_batch,
                               engine.config.max_model_len, runner.kv_cache.shape[2] - 1,
                               capture=runner.device.type == "cuda")


def measure(llm, timer: Timer, batches, ks, context: int) -> dict:
    """{"graphs": {batch: {k: timing}}, "piecewise": {batch: {k: timing}}, "agreement": {batch: {k: fraction}},
    "verify_sizes": {k: capture sizes}}: k = 0 the decode step (in "graphs"); k >= 1 the verify step through the
    verification graphs (whole and inputs built before) and through `runner.forward` (whole)."""
    runner = llm.engine.model_runner
    out = {"graphs": {str(b): {} for b in batches}, "piecewise": {str(b): {} for b in batches},
           "agreement": {str(b): {} for b in batches}, "verify_sizes": {}}
    for b in batches:
        whole, before = step_fns(runner, make_requests(llm, b, context, 1, seed=b * 100), 1, runner.forward)
        t = timer(whole)
        t["inputs_built_before_ms"] = timer(before)["median_ms"]
        out["graphs"][str(b)]["0"] = t
        print(f"batch {b:4d} decode: {t['median_ms']:8.3f} ms", flush=True)
    own = runner.verify_graphs
    for k in ks:
        start = time.perf_counter()
        graphs = runner.verify_graphs = verify_graphs_for(llm, k, max(batches))
        out["verify_sizes"][str(k)] = graphs.sizes
        replays = []
        run_padded = graphs.run_padded
        graphs.run_padded = lambda step: (replays.append(1), run_padded(step))[1]
        print(f"k {k}: verification graphs of {k + 1} rows at sizes {graphs.sizes} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        for b in batches:
            requests = make_requests(llm, b, context, k + 1, seed=b * 100 + k)
            whole, before = step_fns(runner, requests, k + 1, runner.forward_verify)
            replays.clear()
            graphed = whole().tolist()
            if not replays:
                raise RuntimeError(f"batch {b}, k {k}: the verify step did not go through the verification graphs")
            old_whole, _ = step_fns(runner, requests, k + 1, runner.forward)
            old = old_whole().tolist()
            out["agreement"][str(b)][str(k)] = sum(x == y for x, y in zip(graphed, old)) / len(old)
            t = timer(whole)
            t["inputs_built_before_ms"] = timer(before)["median_ms"]
            out["graphs"][str(b)][str(k)] = t
            out["piecewise"][str(b)][str(k)] = timer(old_whole)
            print(f"batch {b:4d} k {k:3d}: {t['median_ms']:8.3f} ms through the verification graphs (inputs built "
                  f"before: {t['inputs_built_before_ms']:.3f}), {out['piecewise'][str(b)][str(k)]['median_ms']:.3f} "
                  f"ms the piecewise way; argmax agreement {out['agreement'][str(b)][str(k)]:.3f}", flush=True)
        del graphs.run_padded                                  # the method again (the engine's own graphs stay)
        runner.verify_graphs = own
        del graphs, run_padded
        gc.collect()
    return out


def measure_eager(llm, timer: Timer, batches, ks, context: int) -> dict:
    """{batch: {k: timing}} with the engine's graphs set aside (decode, piecewise and verification): every step's
    kernels launched from Python, the rows' cost apart from what graphs save. Whole steps only."""
    runner = llm.engine.model_runner
    kept = runner.decode_graphs, runner.piecewise_graphs, runner.verify_graphs
    runner.decode_graphs = runner.piecewise_graphs = runner.verify_graphs = None
    out = {}
    try:
        for b in batches:
            out[str(b)] = {}
            for k in [0, *ks]:
                whole, _ = step_fns(runner, make_requests(llm, b, context, k + 1, seed=b * 100 + k), k + 1,
                                    runner.forward)
                out[str(b)][str(k)] = timer(whole)
            print(f"batch {b:4d}, no graphs: " + ", ".join(f"k={k} {t['median_ms']:.2f} ms"
                                                          for k, t in out[str(b)].items()), flush=True)
    finally:
        runner.decode_graphs, runner.piecewise_graphs, runner.verify_graphs = kept
    return out


def measure_drafting(device: torch.device, dtype, timer: Timer, context: int, ks) -> dict:
    """What drafting k tokens for one request costs, per k >= 1: the n-gram lookup (`propose_ngram` over the
    request's `context` tokens, on the host, `time.perf_counter`) and the shipped draft model's proposer
    (`DraftModelProposer.propose`, its own runner and KV cache, after it has caught up on the context: each call
    feeds the request's last token again, then one forward per further draft token; timed as the target's steps)."""
    from minirt.spec import DRAFT_MODEL, DraftModelProposer, propose_ngram

    ks = [k for k in ks if k >= 1]
    host = Timer(torch.device("cpu"), timer.iters, timer.warmup)
    proposer = DraftModelProposer(None, device, dtype, num_blocks=-(-(context + max(ks) + 1) // 16) + 4)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(proposer.vocab_size, (context,), generator=g).tolist()
    request = Request("draft", None, ids, SamplingParams(max_new_tokens=1, ignore_eos=True), frozenset())
    proposer.propose([request], [1])                                     # catch up on the context (its prefill)
    out = {"draft_model": os.path.relpath(DRAFT_MODEL, ROOT), "ngram": {}, "draft": {}}
    for k in ks:
        out["ngram"][str(k)] = host(lambda: propose_ngram(ids, k))
        out["draft"][str(k)] = timer(lambda: proposer.propose([request], [k]))
        print(f"drafting k {k:3d}: ngram {out['ngram'][str(k)]['median_ms']:.3f} ms, draft model "
              f"{out['draft'][str(k)]['median_ms']:.3f} ms", flush=True)
    return out


def speedup_bounds(acceptance_file: Path, ratio_b1: dict, draft_cost: dict) -> dict:
    """Per drafter and k measured on the CPU: E (the i.i.d. model's at the measured acceptance, and the measured
    tokens per forward) over the step's cost in decode steps: verify ratio + drafting cost (`draft_cost[drafter][k]`,
    in batch-1 decode steps)."""
    if not acceptance_file.exists():
        return {"note": f"{acceptance_file} not found: no bound at a measured acceptance"}
    measured = json.loads(acceptance_file.read_text())
    bounds = {"source": {"file": os.path.relpath(acceptance_file, ROOT), "commit": measured.get("commit")}}
    for drafter, by_k in measured["results"].items():
        bounds[drafter] = {}
        for k, r in by_k.items():
            c = draft_cost.get(drafter, {}).get(k)
            if c is None or ratio_b1.get(k) is None:
                continue
            a, tpf = r["acceptance_rate"], r["tokens_per_target_forward"]
            cost = ratio_b1[k] + c
            iid = None if a is None else (int(k) + 1 if a >= 1 else (1 - a ** (int(k) + 1)) / (1 - a))
            bounds[drafter][k] = {"acceptance_rate": a, "tokens_per_target_forward": tpf, "verify_ratio": ratio_b1[k],
                                  "draft_cost_in_decode_steps": c, "cost_in_decode_steps": cost,
                                  "bound_iid": None if iid is None else iid / cost, "bound_measured": tpf / cost}
    return bounds


def ratios(steps: dict, key: str = "median_ms") -> dict:
    """{batch: {k: steps[batch][k][key] / steps[batch]["0"][key]}}: each step in decode steps of its batch."""
    return {b: {k: None if t is None else t[key] / row["0"][key] for k, t in row.items()} for b, row in steps.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: cut-down shape on the CPU, fewer points")
    parser.add_argument("--context", type=int, default=None, help="tokens in the KV cache per request (512; quick 64)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (1,8,32)")
    parser.add_argument("--ks", default=None, help="comma-separated k values >= 1 (1..8); the decode step is k = 0")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per point (30; quick 5)")
    parser.add_argument("--acceptance", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "spec-decode.json")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    quick_cpu = args.quick and device.type == "cpu"
    context = args.context or (64 if args.quick else 512)
    batches = [int(x) for x in args.batches.split(",")] if args.batches else ([1, 3, 8] if args.quick else BATCHES)
    ks = sorted({int(x) for x in args.ks.split(",")} - {0}) if args.ks else ([1, 2, 4, 8] if args.quick else KS)
    iters = args.iters or (5 if args.quick else 30)
    machine = device.type.replace("cuda", "h200")
    out_dir = args.out or (None if quick_cpu else str(ROOT / "benchmarks" / "results" / machine))
    config = SMALL if quick_cpu else QWEN3_0_6B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    timer = Timer(device, iters)
    report = report_header(device)                   # the commit measured, read before the run
    started = time.perf_counter()
    wall = {}

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(tmp, config, device)
        llm = engine_for(path, device, dtype, batches, context, ks)
        plan = llm.engine.plan
        wall["engine_built_s"] = time.perf_counter() - started
        print(f"engine built in {wall['engine_built_s']:.1f} s; plan: {plan}", flush=True)
        measured = measure(llm, timer, batches, ks, context)
        wall["graphs_and_piecewise_s"] = time.perf_counter() - started - sum(wall.values())
        steps_eager = measure_eager(llm, Timer(device, min(iters, EAGER_ITERS)),
                                    [b for b in batches if b <= EAGER_BATCHES], ks, context)
        wall["eager_s"] = time.perf_counter() - started - sum(wall.values())
        del llm
        gc.collect()
    steps = measured["graphs"]
    piecewise = {b: {"0": steps[b]["0"], **row} for b, row in measured["piecewise"].items()}
    ratio = ratios(steps)

    drafting = measure_drafting(device, dtype, timer, context, ks)
    wall["drafting_s"] = time.perf_counter() - started - sum(wall.values())
    decode_b1 = steps["1"]["0"]["median_ms"] if "1" in steps else None
    draft_cost = {} if decode_b1 is None else {
        drafter: {k: t["median_ms"] / decode_b1 for k, t in drafting[drafter].items()}
        for drafter in ("ngram", "draft")}
    all_ks = [0, *ks]

    report.update({
        "model": {"name": "Qwen3-0.6B configuration, random weights" if not quick_cpu else
                  "Qwen3 cut down (2 layers, hidden 256, vocab 4096), random weights", "config": config,
                  "dtype": str(dtype).removeprefix("torch.")},
        "plan": {f: getattr(plan, f) for f in plan.__dataclass_fields__},
        "workload": {"context_tokens": context, "batches": batches, "ks": all_ks, "iters": iters,
                     "eager_iters": min(iters, EAGER_ITERS),
                     "timing": "CUDA events" if device.type == "cuda" else "perf_counter",
                     "step": "median_ms: the whole step, its inputs built by the host inside the timing (as every "
                             "single engine step does; the plain engine's multi-step bursts hide part of that at "
                             "batch 1); inputs_built_before_ms: the same step with its inputs built once beforehand. "
                             "k = 0: decode (runner.forward through the decode graphs + sampler); k >= 1: verify "
                             "(runner.forward_verify through the verification graphs of k+1 rows per request, every "
                             "row sampled, compute_logits, argmax: SpeculativeSteps.verify's forward for a step of "
                             "running requests). step_ms_piecewise: the verify step through runner.forward, the "
                             "piecewise graphs (the path verification took before its own graphs). step_ms_eager: "
                             "every step with the engine's graphs set aside, kernels launched from Python.",
                     "verify_graph_sizes": measured["verify_sizes"]},
        "wall_s": wall,
        "step_ms": steps, "ratio_to_decode": ratio,
        "ratio_to_decode_inputs_built_before": ratios(steps, "inputs_built_before_ms"),
        "step_ms_piecewise": piecewise, "ratio_to_decode_piecewise": ratios(piecewise),
        "agreement": measured["agreement"],
        "step_ms_eager": steps_eager, "ratio_to_decode_eager": ratios(steps_eager),
        "drafting_ms": drafting, "drafting_in_batch1_decode_steps": draft_cost,
        "speedup_bound_batch1": speedup_bounds(args.acceptance, ratio.get("1", {}), draft_cost),
    })
    for title, table in (("verification graphs", ratio), ("piecewise (before)", report["ratio_to_decode_piecewise"]),
                         ("no graphs", report["ratio_to_decode_eager"])):
        print(f"\nverify step / decode step, {title} (context {context}, medians)")
        print("batch " + "".join(f"{'k=' + str(k):>8s}" for k in all_ks))
        for b, row in table.items():
            print(f"{b:>5s} " + "".join(f"{'-' if row.get(str(k)) is None else f'{row[str(k)]:.2f}':>8s}"
                                        for k in all_ks))
    bounds = report["speedup_bound_batch1"]
    for drafter in ("ngram", "draft"):
        for k, r in bounds.get(drafter, {}).items():
            print(f"{drafter:6s} k={k}: acceptance {r['acceptance_rate'] or 0:.2f}, "
                  f"cost {r['cost_in_decode_steps']:.2f} "
                  f"decode steps -> speedup bound {r['bound_measured']:.2f} (measured tokens/forward)")
    print(f"\nwall time {time.perf_counter() - started:.0f} s: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    if out_dir:
        write_report(report, out_dir, "spec-verify" + ("-quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
