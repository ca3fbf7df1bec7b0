"""Benchmark minirt against `transformers` in one run: `python -m minirt bench [--device cuda|cpu] ...`.

Every system runs the same prompts (random token ids, seeded), greedy, EOS ignored, after a warm-up:

* minirt: `minirt.LLM.generate`, all requests submitted at once; TTFT/TPOT from `RequestOutput.metrics`.
* hf_generate: `transformers` `generate`, static batching (left-padded batches, `do_sample=False`, EOS off).
  It returns only when its batch is done, so its TTFT is derived: the time its batch started (batches run
  one after the other) plus that batch's prefill, timed with a 1-token `generate` after the run; its TPOT
  is (batch time - prefill) / (new tokens - 1).
* hf_generate_batch: `transformers` continuous batching with paged attention (`generate_batch`), timed by
  its per-token timestamps (`record_timestamps=True`) from each request's creation; wall time runs from
  the first creation to the last token, so the manager's setup (cache allocation, CUDA-graph capture) is
  left out, as minirt's engine construction is.

Figures (`minirt.metrics.summarize` for all three): output tokens/s = all output tokens / wall time, TTFT
and TPOT p50/p99 in seconds, and on the batch-1 latency workload the fraction of the bandwidth roofline,
(weight bytes / TPOT p50) / copy bandwidth. The copy bandwidth counts read + write (2 x the size of a
device-to-device `copy_`): bytes moved through memory per second, as a decode step's weight reads are.
KV-cache reads are not counted, which makes the fraction conservative.

`--quantization none,int8,fp8` runs minirt once per format on the same checkpoint and prompts (chapter 10): each
quantized system's roofline counts the bytes its step reads (one byte per quantized weight plus its float32 scales;
the float embeddings, LM head and norms as they are), and its throughput is compared with unquantized minirt's.
`--speculative none,ngram,draft` does the same for speculative decoding (chapter 11): one system per drafter
("minirt_ngram", ...; with both lists, one per pair), each with its drafting figures and its throughput over plain
minirt's on the same prompts.

The CLI pieces are `add_parser(subparsers)` and `run(args) -> int`; `main(argv)` runs them standalone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import torch
from torch.nn.attention import sdpa_kernel

from minirt.attention import CUDA_SDPA_BACKENDS
from minirt.config import ATTENTION_BACKENDS, QUANTIZATION_METHODS, SPECULATIVE_METHODS, EngineConfig
from minirt.fast import resolve_plan
from minirt.fast.flash_attn import FlashAttnPagedAttention

# Qwen3-0.6B's configuration (Qwen/Qwen3-0.6B config.json), built with random weights: no download needed.
QWEN3_0_6B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645}
# (requests, (shortest, longest prompt), new tokens per request), by (device type, quick); lengths uniform.
WORKLOADS = {
    ("cuda", False): {"throughput": (256, (100, 1024), 512), "latency": (1, (512, 512), 256)},
    ("cuda", True): {"throughput": (32, (100, 1024), 64), "latency": (1, (512, 512), 128)},
    ("cpu", False): {"throughput": (16, (16, 128), 64), "latency": (1, (256, 256), 128)},
    ("cpu", True): {"throughput": (4, (8, 32), 8), "latency": (1, (16, 16), 8)},
}
BASELINES = {"cuda": ("hf_generate", "hf_generate_batch"), "cpu": ("hf_generate",)}
# (workload, ratio, target). Ratios: minirt tokens/s / a baseline's ("tokens_per_s_vs_<baseline>"), and
# minirt's "roofline_fraction" on the latency workload.
TARGETS = {"cuda": [("throughput", "tokens_per_s_vs_hf_generate_batch", 25.0), ("latency", "roofline_fraction", 0.6)],
           "cpu": [("throughput", "tokens_per_s_vs_hf_generate", 2.0)]}
# (workload, figure, method or None for every method, target, True: a bound from above) for quantized systems:
# chapter 10's goals on the H200, FP8 batch-1 TPOT at most 0.40 ms (1.57x faster than the bf16 step measured
# before quantization), 45 % of the quantized step's own roofline, throughput no lower than bf16's.
QUANT_TARGETS = {"cuda": [("latency", "tpot_p50_s", "fp8", 0.40e-3, True),
                          ("latency", "roofline_fraction", None, 0.45, False),
                          ("throughput", "tokens_per_s_vs_minirt", None, 1.0, False)]}
# (workload, figure, target) for speculative systems: where drafting cannot pay (256 requests, far above
# speculative_max_batch), the engine runs as the plain one and must not lose to it.
SPEC_TARGETS = {"cuda": [("throughput", "tokens_per_s_vs_minirt", 1.0)]}
GUARD_PROMPTS, GUARD_TOKENS, WARMUP_REQUESTS, WARMUP_TOKENS = 4, 32, 8, 8


def commit() -> str | None:
    """The measured tree's commit (with "-dirty" when it has uncommitted changes), or None outside git.
    `MINIRT_COMMIT` in the environment names it instead, for a copy of a commit outside its repository."""
    if os.environ.get("MINIRT_COMMIT"):
        return os.environ["MINIRT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha.strip() + ("-dirty" if dirty else "")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids in [1, vocab), lengths uniform in `lengths` (inclusive)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> dict:
    """Bytes/s of a device-to-device `copy_` of `nbytes`, counting read + write; median of `iters` copies.
    Timed with CUDA events on a GPU, `time.perf_counter` on the CPU."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)   # written, so the CPU reads real pages
    dst = torch.zeros_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    seconds = sorted(times)[len(times) // 2]
    del src, dst
    free_memory()
    return {"bytes_copied": nbytes, "bytes_moved": 2 * nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


def summarize_latencies(ttft, tpot, e2e, tokens, wall: float, how: str) -> dict:
    """`minirt.metrics.summarize` of per-request latencies (seconds) measured outside minirt."""
    from minirt.metrics import summarize
    from minirt.request import RequestMetrics, RequestOutput

    outs = [RequestOutput(f"req-{i}", None, [], t, "", "length", metrics=RequestMetrics(queue_s=None, ttft_s=a,
                          tpot_s=b, e2e_s=c)) for i, (a, b, c, t) in enumerate(zip(ttft, tpot, e2e, tokens))]
    return {**summarize(outs, wall), "how": how}


# ---------------------------------------------------------------------------------------------- the three systems
def run_minirt(llm, prompts: list[list[int]], n: int, device: torch.device) -> tuple[dict, list[list[int]]]:
    from minirt.metrics import summarize
    from minirt.sampling import SamplingParams

    comm = getattr(llm.engine.model_runner, "comm", None)       # tensor parallelism: its collectives' clock
    comm_s, steps = (comm.seconds if comm else 0.0), llm.engine.num_steps
    spec_before = speculation_counts(llm.engine)
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    sync(device)
    wall = time.perf_counter() - start
    bad = [f"{o.request_id}: {o.finish_reason} {o.error or ''}" for o in outs if len(o.token_ids) != n]
    if bad:
        raise RuntimeError(f"minirt: {len(bad)} requests did not generate {n} tokens: {bad[:3]}")
    figures = {**summarize(outs, wall), "how": "RequestOutput.metrics"}
    figures.update(speculation_figures(spec_before, speculation_counts(llm.engine)))
    if comm is not None and comm.timed:
        steps = llm.engine.num_steps - steps
        figures.update(steps=steps, step_s=wall / steps, collective_s_per_step=(comm.seconds - comm_s) / steps)
    return figures, [o.token_ids for o in outs]


def speculation_counts(engine) -> dict | None:
    """The speculative step's counts so far (`minirt.spec.engine.SpeculativeSteps.stats`), None without it."""
    speculation = getattr(engine, "speculation", None)
    return None if speculation is None else speculation.stats()


def speculation_figures(before: dict | None, after: dict | None) -> dict:
    """A run's speculative figures from the counts before and after it: drafts verified, draft tokens, accepted
    tokens, the acceptance rate (accepted / drafted) and the tokens per target forward (tokens a request got per
    verification forward that sampled it, drafts or not; the steps that draft nothing run as the plain engine's and
    are not counted). Empty without speculation."""
    if after is None:
        return {}
    d = {k: after[k] - before[k] for k in after}
    return {"spec_drafts": d["spec_num_drafts"], "spec_draft_tokens": d["spec_num_draft_tokens"],
            "spec_accepted_tokens": d["spec_num_accepted_tokens"],
            "acceptance_rate": d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"]
            if d["spec_num_draft_tokens"] else None,
            "tokens_per_target_forward": d["spec_num_emitted_tokens"] / d["spec_num_target_forwards"]
            if d["spec_num_target_forwards"] else None}


def hf_generate(model, prompts: list[list[int]], n: int, device: torch.device, max_batch: int | None = None
                ) -> tuple[list[list[float]], list[list[int]]]:
    """`n` greedy tokens per prompt from transformers' static-batch `generate`, EOS off, left padding.

    Batches of `max_batch` prompts (all by default; halved on out-of-memory) run one after the other.
    Returns one row per batch, [start, total, prefill, batch size] (seconds from the run's start; the
    prefill is a 1-token `generate` of the batch, timed after the run), and the generated ids per prompt.
    """
    max_batch = max_batch or len(prompts)
    while True:
        try:
            return _hf_static_batches(model, prompts, n, device, max_batch)
        except torch.OutOfMemoryError:
            if max_batch == 1:
                raise
            max_batch = (max_batch + 1) // 2
            print(f"hf_generate: out of memory, retrying with batches of {max_batch}", file=sys.stderr)
            free_memory()


@torch.inference_mode()
def _hf_static_batches(model, prompts, n, device, max_batch):
    def call(batch, new_tokens):
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        # minirt's CUDA SDPA backends: under memory pressure (after an out-of-memory retry) cuDNN's attention
        # failed with an opaque RuntimeError ("mha_graph.execute") on the H200 instead of running out of memory.
        backends = sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()
        with backends:
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()

    batches = [prompts[i:i + max_batch] for i in range(0, len(prompts), max_batch)]
    rows, tokens = [], []
    sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        start = time.perf_counter()
        tokens += call(batch, n)
        sync(device)
        rows.append([start - t0, time.perf_counter() - start])
    for row, batch in zip(rows, batches):
        start = time.perf_counter()
        call(batch, 1)
        sync(device)
        row += [time.perf_counter() - start, len(batch)]
    return rows, tokens


def run_hf_generate(model, prompts, n, device) -> dict:
    rows, tokens = hf_generate(model, prompts, n, device)
    if any(len(t) != n for t in tokens):
        raise RuntimeError(f"generate: a batch stopped before {n} tokens")
    ttft, tpot, e2e = [], [], []
    for start, total, prefill, size in rows:
        ttft += [start + prefill] * size
        tpot += [(total - prefill) / (n - 1) if n > 1 else None] * size
        e2e += [start + total] * size
    fig = summarize_latencies(ttft, tpot, e2e, tokens, rows[-1][0] + rows[-1][1],
                              "TTFT = batch start + its 1-token generate; TPOT = (batch time - that) / (n - 1)")
    return {**fig, "batch_size": rows[0][3]}


def run_hf_generate_batch(model, prompts, n, device=None) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)  # -1: EOS off
    start = time.perf_counter()
    outs = list(model.generate_batch(inputs=prompts, generation_config=config, record_timestamps=True).values())
    call_wall = time.perf_counter() - start
    errors = [f"{o.request_id}: {o.error or f'{len(o.generated_tokens)} tokens'}" for o in outs
              if o.error or len(o.generated_tokens) != n]
    if errors or len(outs) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(outs)} results for {len(prompts)} prompts; {errors[:3]}")
    fig = summarize_latencies([o.timestamps[0] - o.created_time for o in outs],
                              [(o.timestamps[-1] - o.timestamps[0]) / (n - 1) if n > 1 else None for o in outs],
                              [o.timestamps[-1] - o.created_time for o in outs], [o.generated_tokens for o in outs],
                              max(o.timestamps[-1] for o in outs) - min(o.created_time for o in outs),
                              "per-token timestamps from request creation; wall = first creation -> last token")
    # how long the first step waited after the first request was created (the loop thread's start-up)
    first_step_delay = min(o.lifespan[0] for o in outs) - min(o.created_time for o in outs)
    return {**fig, "call_wall_time_s": call_wall, "first_step_delay_s": first_step_delay}


# ---------------------------------------------------------------------------------------------- the run
def build_random_qwen3(path: str, device: torch.device, seed: int, config: dict | None = None) -> str:
    """Save a Qwen3 model with random bfloat16 weights (built by transformers) to `path`: Qwen3-0.6B's
    configuration, or `config` (a dict of `Qwen3Config` fields) for another shape."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**(config or QWEN3_0_6B)), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    free_memory()
    return path


def environment(device: torch.device) -> tuple[dict, dict]:
    """(device: type, name, threads, load average; versions of python, torch, transformers, triton, ...)."""
    import transformers

    import minirt

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    if device.type == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "transformers": transformers.__version__, "minirt": minirt.__version__}
    for package in ("triton", "flash-attn", "flash-attn-4"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return ({"type": device.type, "name": name, "num_threads": torch.get_num_threads(),
             "load_average_1min": os.getloadavg()[0]}, versions)


def report_header(device: torch.device) -> dict:
    """What every benchmark report starts with: the device, the library versions (`environment`), the commit
    measured (`commit`) and the date."""
    dev, versions = environment(device)
    return {"device": dev, "versions": versions, "commit": commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def agreement(mine: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy-token agreement: the fraction of prompts with equal tokens, the mean common-prefix fraction."""
    def prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(len(b), 1)

    return {"num_prompts": len(theirs), "max_new_tokens": len(theirs[0]),
            "exact_match": sum(a == b for a, b in zip(mine, theirs)) / len(theirs),
            "prefix_agreement": sum(prefix(a, b) for a, b in zip(mine, theirs)) / len(theirs)}


def compute_ratios(results: dict, device_type: str, systems: dict | None = None) -> list[dict]:
    """minirt / baseline output tokens/s for each workload and baseline; minirt's roofline fraction (latency); and
    the figures of minirt's variants (`variant_ratios`; `systems`: each system's quantization and speculative)."""
    targets = {(w, name): t for w, name, t in TARGETS[device_type]}
    ratios, variants = [], systems or {}
    for workload, systems in results.items():
        values = {}
        if "minirt" in systems:
            mine = systems["minirt"]
            values = {f"tokens_per_s_vs_{b}": None if "error" in fig else mine["output_tokens_per_s"] /
                      fig["output_tokens_per_s"] for b, fig in systems.items() if not b.startswith("minirt")}
            if workload == "latency":
                values["roofline_fraction"] = mine.get("roofline_fraction")
        for name, value in values.items():
            target = targets.get((workload, name))
            status = None if target is None else "n/a" if value is None else "PASS" if value >= target else "MISS"
            ratios.append({"workload": workload, "name": name, "value": value, "target": target, "status": status})
        ratios += variant_ratios(workload, systems, device_type, variants)
    return ratios


def variant_ratios(workload: str, systems: dict, device_type: str, variants: dict) -> list[dict]:
    """The figures of minirt's variants (every system named "minirt_..."; `variants[name]` says its `quantization`
    and `speculative`), named "<system>:<figure>": on every workload the output tokens/s over plain minirt's; for a
    quantized system on the latency workload also the roofline fraction at the quantized bytes and TPOT p50. Goals:
    a quantized system's `QUANT_TARGETS` (TPOT p50 a bound from above: PASS at or below it), a speculative one's
    `SPEC_TARGETS` (not for a system that is both)."""
    quant_targets = {(w, name, method): (t, below)
                     for w, name, method, t, below in QUANT_TARGETS.get(device_type, [])}
    spec_targets = {(w, name): t for w, name, t in SPEC_TARGETS.get(device_type, [])}
    ratios = []
    for system, fig in systems.items():
        if not system.startswith("minirt_"):
            continue
        variant = variants.get(system, {})
        method, drafter = variant.get("quantization"), variant.get("speculative")
        values = {}
        if "minirt" in systems:
            values["tokens_per_s_vs_minirt"] = fig["output_tokens_per_s"] / systems["minirt"]["output_tokens_per_s"]
        if workload == "latency" and method is not None:
            values.update(roofline_fraction=fig.get("roofline_fraction"), tpot_p50_s=fig.get("tpot_p50_s"))
        for name, value in values.items():
            target, below = None, False
            if drafter is None:
                target, below = quant_targets.get((workload, name, method),
                                                  quant_targets.get((workload, name, None), (None, False)))
            elif method is None:
                target = spec_targets.get((workload, name))
            status = (None if target is None else "n/a" if value is None else
                      "PASS" if (value <= target if below else value >= target) else "MISS")
            ratios.append({"workload": workload, "name": f"{system}:{name}", "value": value, "target": target,
                           "status": status, **({"bound": "at most"} if below and target is not None else {})})
    return ratios


def kernel_name(runner) -> str:
    """The attention kernel a model runner calls, with its bound options (the split counters left out)."""
    kernel = getattr(runner, "kernel", None)
    if kernel is None:
        return "paged_attention_reference"
    if isinstance(kernel, FlashAttnPagedAttention):
        return f"flash_attn ({kernel.name})"
    if not hasattr(kernel, "func"):
        return kernel.__name__
    return f"{kernel.func.__name__}{ {k: v for k, v in kernel.keywords.items() if k != 'split_counters'} }"


def bench(device: torch.device, workloads: list[str], quick: bool = False, model: str | None = None,
          baselines: tuple[str, ...] = ("hf_generate",), seed: int = 0, engine_kwargs: dict | None = None,
          time_collectives: bool = False, quantizations: tuple[str | None, ...] = (None,),
          weight_block_size: int | None = None, speculatives: tuple[str | None, ...] = (None,),
          speculative_kwargs: dict | None = None) -> dict:
    """Run minirt and the baselines on each workload; returns the report that `run` writes as JSON.
    `engine_kwargs` go to `minirt.LLM` (for example `enforce_eager=True`, `tensor_parallel_size=2`). With tensor
    parallelism, minirt's figures add the seconds per step in the model's collectives (`collective_s_per_step`):
    always on the CPU, on CUDA with `time_collectives` (a device sync around each collective, which slows it).
    `quantizations`: minirt runs once per entry on the same checkpoint and prompts, None as loaded (system
    "minirt"), "int8" or "fp8" quantized at load with `weight_block_size` (system "minirt_int8", ...); each
    system's roofline counts the bytes its decode step reads (`step_weight_bytes`), and `report["quantization"]`
    holds each one's bytes, plan and greedy agreement with the first system's tokens. `speculatives`: likewise one
    system per drafter (None: no speculation; "ngram" or "draft": system "minirt_ngram", ...), with
    `speculative_kwargs` (`num_speculative_tokens`, `speculative_model`: `system_settings`); with both lists, one
    system per pair, plain minirt first; `report["speculative"]` holds the systems as `report["quantization"]`
    does."""
    from transformers import AutoModelForCausalLM

    import minirt

    random.seed(seed)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = {w: dict(zip(("num_requests", "prompt_len", "max_new_tokens"), WORKLOADS[device.type, quick][w]))
                for w in workloads}
    report = {**report_header(device),
              "settings": {"quick": quick, "seed": seed, "dtype": str(dtype).removeprefix("torch."),
                           "baselines": list(baselines), "workloads": settings, "engine": engine_kwargs or {}},
              "bandwidth": copy_bandwidth(device, 2**31 if device.type == "cuda" else 2**28)}
    results = {w: {} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        if model is None and device.type == "cuda":
            model = build_random_qwen3(tmp, device, seed)
            report["model"] = {"name": "Qwen3-0.6B configuration, random weights", "config": QWEN3_0_6B}
        else:
            model = str(model or minirt.DEFAULT_MODEL)
            report["model"] = {"name": os.path.basename(os.path.normpath(model)), "path": model}

        systems, guard_tokens = {}, None
        pairs = [(q, d) for q in sorted(quantizations, key=lambda q: q is not None)   # plain first: the headline
                 for d in sorted(speculatives, key=lambda d: d is not None)]
        for quant, drafter in pairs:
            name = system_name(quant, drafter)
            kwargs = system_settings(engine_kwargs, quant, weight_block_size, drafter, speculative_kwargs)
            llm = minirt.LLM(model, device=device, dtype=dtype, **kwargs)
            engine = llm.engine
            if time_collectives and getattr(engine.model_runner, "comm", None) is not None:
                engine.model_runner.comm.timed = True
            resolved = {**engine.plan.as_dict(), "attention_kernel": kernel_name(engine.model_runner),
                        "num_kv_blocks": engine.config.num_kv_blocks, "max_num_seqs": engine.config.max_num_seqs,
                        "max_model_len": engine.config.max_model_len}
            systems[name] = {"quantization": quant, "weight_block_size": None if quant is None else weight_block_size,
                             "speculative": drafter, "weight_bytes": step_weight_bytes(engine.model),
                             "engine_resolved": resolved}
            if guard_tokens is None:           # the first system: the report's headline fields, the prompts
                report["settings"]["engine_resolved"] = resolved
                report["model"]["weight_bytes"] = systems[name]["weight_bytes"]
                vocab = engine.model.config.vocab_size
                prompts = {w: make_prompts(s["num_requests"], s["prompt_len"], vocab, seed + i)
                           for i, (w, s) in enumerate(settings.items())}
                warmup = {w: (make_prompts(min(s["num_requests"], WARMUP_REQUESTS), s["prompt_len"], vocab,
                                           seed + 100 + i), min(WARMUP_TOKENS, s["max_new_tokens"]))
                          for i, (w, s) in enumerate(settings.items())}
                first = next(iter(settings.values()))
                guard = (make_prompts(GUARD_PROMPTS, first["prompt_len"], vocab, seed + 200),
                         min(GUARD_TOKENS, first["max_new_tokens"]))
            _, tokens = run_minirt(llm, *guard, device)
            if guard_tokens is None:
                guard_tokens, first_system = tokens, name
            else:
                systems[name]["greedy_vs_" + first_system] = agreement(tokens, guard_tokens)
            for w, s in settings.items():
                run_minirt(llm, *warmup[w], device)
                results[w][name], _ = run_minirt(llm, prompts[w], s["max_new_tokens"], device)
            close = getattr(engine.model_runner, "close", None)       # tensor parallelism: join the ranks
            if close is not None:
                close()
            del llm, engine
            free_memory()
        if quantizations != (None,):
            report["quantization"] = systems
        if speculatives != (None,):
            report["speculative"] = systems
        if not baselines:
            return finish_report(report, results, systems, device.type)

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None       # else generate() falls back to the checkpoint's EOS
        _, hf_guard_tokens = hf_generate(hf, *guard, device, max_batch=1)
        report["correctness"] = {**agreement(guard_tokens, hf_guard_tokens), "system": first_system}
        runners = {"hf_generate": run_hf_generate, "hf_generate_batch": run_hf_generate_batch}
        for w, s in settings.items():
            for b in baselines:
                try:
                    runners[b](hf, *warmup[w], device)
                    results[w][b] = runners[b](hf, prompts[w], s["max_new_tokens"], device)
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
                    results[w][b] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                free_memory()
        del hf
        free_memory()
    return finish_report(report, results, systems, device.type)


def finish_report(report: dict, results: dict, systems: dict, device_type: str) -> dict:
    """The derived figures: each latency figure's roofline fraction, at its system's step bytes (the baselines at
    the float model's, the first system's when it is unquantized), and the ratios (`compute_ratios`)."""
    float_bytes = report["model"]["weight_bytes"]
    for name, fig in results.get("latency", {}).items():
        if fig.get("tpot_p50_s"):
            nbytes = systems[name]["weight_bytes"] if name in systems else float_bytes
            fig["roofline_fraction"] = nbytes / fig["tpot_p50_s"] / report["bandwidth"]["bytes_per_s"]
    report["results"] = results
    report["ratios"] = compute_ratios(results, device_type, systems)
    return report


def system_name(quantization: str | None, speculative: str | None = None) -> str:
    """minirt's system name in the report: "minirt" unquantized and without speculation, else "minirt" followed by
    "_<method>" and "_<drafter>" ("minirt_int8", "minirt_ngram", "minirt_fp8_draft")."""
    return "_".join(["minirt", *(part for part in (quantization, speculative) if part is not None)])


def system_settings(engine_kwargs: dict | None, quantization: str | None, weight_block_size: int | None,
                    speculative: str | None, speculative_kwargs: dict | None) -> dict:
    """The `minirt.LLM` settings of one system: the command line's, its quantization (with `weight_block_size`), and
    its drafter with `speculative_kwargs` (`num_speculative_tokens` for either drafter, `speculative_model` for
    "draft" only: `EngineConfig` refuses them elsewhere)."""
    kwargs = dict(engine_kwargs or {})
    if quantization is not None:
        kwargs.update(quantization=quantization, weight_block_size=weight_block_size)
    if speculative is not None:
        kwargs["speculative"] = speculative
        kwargs.update({k: v for k, v in (speculative_kwargs or {}).items()
                       if k != "speculative_model" or speculative == "draft"})
    return kwargs


def step_weight_bytes(model) -> int:
    """Bytes of weights a batch-1 decode step reads: every parameter once (tied embeddings and LM head count once:
    the LM head reads them all) and every quantized weight and its scales (`weight`, `weight_scale` buffers of the
    quantized linears), each tensor counted once. The KV cache, and tables such as the rotary cache, are left out."""
    tensors = {t.data_ptr(): t for t in model.parameters()}
    for module in model.modules():
        if isinstance(getattr(module, "weight_scale", None), torch.Tensor):
            for t in (module.weight, module.weight_scale):
                tensors[t.data_ptr()] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def format_report(report: dict) -> str:
    from minirt.metrics import format_table

    keys = ["num_requests", "output_tokens", "wall_time_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
            "tpot_p50_s", "tpot_p99_s"]
    rows = [[w, name, *(fig.get(k) for k in keys),
             fig["error"][:60] if "error" in fig else fig.get("roofline_fraction")]
            for w, systems in report["results"].items() for name, fig in systems.items()]
    table = format_table(["workload", "system", "requests", "out tok", "wall s", "tok/s", "TTFT p50", "TTFT p99",
                          "TPOT p50", "TPOT p99", "roofline / error"], rows)
    ratios = format_table(["workload", "ratio", "value", "target", "status"],
                          [[r["workload"], r["name"], r["value"], r["target"], r["status"] or ""]
                           for r in report["ratios"]])
    d, m, c = report["device"], report["model"], report.get("correctness")
    collectives = [f"{w}: {fig['collective_s_per_step'] * 1e3:.3f} ms of {fig['step_s'] * 1e3:.3f} ms per step in "
                   "collectives" for w, systems in report["results"].items()
                   for fig in [systems.get("minirt", {})] if "collective_s_per_step" in fig]
    table += "".join(f"\nminirt {line}" for line in collectives)
    speculation = [f"{name} {w}: acceptance rate {fig['acceptance_rate'] or 0:.2f} of {fig['spec_draft_tokens']} "
                   f"draft tokens, {fig['tokens_per_target_forward']:.2f} tokens per target forward"
                   for w, systems in report["results"].items() for name, fig in systems.items()
                   if fig.get("tokens_per_target_forward")]
    table += "".join(f"\nspeculative {line}" for line in speculation)
    lines = [f"{d['name']} ({d['type']}, {d['num_threads']} threads, load {d['load_average_1min']:.1f}); {m['name']}, "
             f"{report['settings']['dtype']}, {m['weight_bytes'] / 1e9:.3f} GB of weights",
             f"copy bandwidth (read + write): {report['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s"]
    if c is not None:
        lines.append(f"greedy tokens equal to transformers' on {c['num_prompts']} prompts x {c['max_new_tokens']} "
                     f"tokens: {c['exact_match']:.0%} of prompts, common prefix {c['prefix_agreement']:.0%}")
    for name, q in report.get("quantization", {}).items():
        agree = next((f"; greedy tokens equal to {k.removeprefix('greedy_vs_')}'s: {v['exact_match']:.0%} of "
                      f"prompts, common prefix {v['prefix_agreement']:.0%}" for k, v in q.items()
                      if k.startswith("greedy_vs_")), "")
        lines.append(f"{name}: {q['weight_bytes'] / 1e9:.3f} GB read per batch-1 step{agree}")
    for name, q in report.get("speculative", {}).items():
        plan = q["engine_resolved"]
        if q["speculative"] is not None:
            agree = next((f"; greedy tokens equal to {k.removeprefix('greedy_vs_')}'s: {v['exact_match']:.0%} of "
                          f"prompts" for k, v in q.items() if k.startswith("greedy_vs_")), "")
            lines.append(f"{name}: k = {plan['num_speculative_tokens']}, drafting at a running batch <= "
                         f"{plan['speculative_max_batch']}{agree}")
    return "\n".join(lines) + f"\n\n{table}\n\n{ratios}"


def write_report(report: dict, out_dir: str, name: str) -> str:
    """Write `report` as indented JSON to `out_dir/name`.json (the folder is created); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {path}")
    return path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an argparse subparsers object (`python -m minirt bench ...`)."""
    p = subparsers.add_parser("bench", help="benchmark minirt against transformers generate / generate_batch",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workload", choices=["throughput", "latency", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="small workloads, for smoke runs")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="directory of the JSON report")
    p.add_argument("--model", default=None,
                   help="HF-format checkpoint (default: random Qwen3-0.6B on cuda, the embedded model on cpu)")
    p.add_argument("--baselines", default=None,
                   help="comma-separated hf_generate,hf_generate_batch, or none (default: both on cuda, hf_generate "
                        "on cpu)")
    p.add_argument("--quantization", default=None,
                   help="comma-separated none,int8,fp8: minirt once per entry, same checkpoint and prompts, quantized "
                        "at load (EngineConfig.quantization; default: the model as loaded)")
    p.add_argument("--weight-block-size", type=_positive_int, default=None,
                   help="the quantized entries' B x B scale blocks (EngineConfig.weight_block_size; default: one "
                        "scale per output channel)")
    p.add_argument("--name", default=None, help="the JSON report's file name, without .json (default: from the "
                                                 "device, the settings and the date)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default="auto",
                   help="the attention kernel (EngineConfig.attention_backend; flash_attn: the flash-attn package)")
    p.add_argument("--no-split-kv", action="store_true", help="minirt's Triton kernel without split-KV decode")
    p.add_argument("--enforce-eager", action="store_true", help="minirt without CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="minirt's ranks (chapter 09: one process each, gloo on the CPU, NCCL on GPUs)")
    p.add_argument("--time-collectives", action="store_true",
                   help="with tensor parallelism on CUDA, time the collectives (a device sync around each)")
    p.add_argument("--num-scheduler-steps", type=_positive_int, default=None,
                   help="minirt's decode steps per schedule when all requests decode (default: 8 with CUDA graphs, else 1)")
    for name, what in ON_OFF_SWITCHES:
        p.add_argument("--" + name.replace("_", "-"), choices=["auto", "on", "off"], default="auto", help=what)
    p.add_argument("--speculative", default=None,
                   help="comma-separated none,ngram,draft: minirt once per entry, same checkpoint and prompts, with "
                        "speculative decoding (chapter 11: n-gram prompt lookup or the draft model; none: without)")
    p.add_argument("--num-speculative-tokens", type=_positive_int, default=None,
                   help="draft tokens per step of the --speculative entries (default: 4)")
    p.add_argument("--speculative-model", default=None,
                   help="the draft checkpoint of the --speculative draft entry (default: minirt's draft model)")
    return p


#: The `EngineConfig` switches the bench takes as `--name on|off|auto` (auto: the engine's default), with their help.
ON_OFF_SWITCHES = (
    ("fused_ops", "minirt's torch.compile-fused elementwise ops (auto: on CUDA only)"),
    ("merge_projections", "minirt's merged q/k/v and gate/up GEMMs (auto: on CUDA only)"),
    ("gemv", "minirt's Triton matrix-vector kernel for one-row GEMMs (auto: with CUDA graphs)"),
    ("norm_in_gemv", "minirt's norms in the GEMV kernel's prologue for one-token steps (auto: with gemv, merged)"),
    ("rotary_kernel", "minirt's q/k norm and rotation in one Triton kernel (auto: with CUDA graphs)"),
    ("pdl", "minirt's Triton kernels with programmatic dependent launch (auto: with CUDA graphs, Hopper+)"),
    ("kv_write_in_rotary", "minirt's K/V cache write inside the rotary kernel (auto: with the rotary kernel)"),
    ("combine_in_attention", "minirt's split-KV combine inside the attention kernel (auto: off; slower where PDL runs)"),
    ("prefetch_kv", "minirt's attention kernel loads earlier steps' K/V before its PDL wait (auto: with PDL)"),
    ("l2_prefetch", "minirt's one-row GEMVs ask L2 for the next GEMV's weights (auto: with the GEMV kernel, merged "
                    "projections and PDL)"),
    ("overlap_scheduling", "minirt launches the next decode burst before taking this one's tokens (auto: with "
                           "multi-step decode)"),
    ("piecewise_graphs", "minirt replays steps with prefill chunks as CUDA graphs cut at each attention call (auto: "
                         "with CUDA graphs)"),
    ("async_scheduling", "minirt launches a step with prefill chunks before taking the tokens of the one before (auto: "
                         "with piecewise CUDA graphs)"),
    ("silu_and_mul_kernel", "minirt's SiLU-and-multiply in a Triton kernel (auto: on CUDA where Triton runs)"),
    ("rotary_cache", "minirt looks cos and sin up per position in a table filled once (auto: on CUDA)"),
    ("argmax_in_gemv", "minirt takes a greedy one-row step's argmax in the LM head GEMV's epilogue (auto: with the "
                       "GEMV kernel)"),
    ("verify_graphs", "minirt's speculative verification steps replay CUDA graphs of k+1 rows per request (auto: off; "
                      "on needs --speculative and CUDA graphs)"),
)


def engine_kwargs_of(args) -> dict:
    """The `minirt.LLM` settings given on the command line (only those that differ from the defaults)."""
    kwargs = {}
    if args.attention_backend != "auto":
        kwargs["attention_backend"] = args.attention_backend
    if args.no_split_kv:
        kwargs["split_kv"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    for name, _ in ON_OFF_SWITCHES:
        if getattr(args, name) != "auto":
            kwargs[name] = getattr(args, name) == "on"
    if args.num_scheduler_steps is not None:
        kwargs["num_scheduler_steps"] = args.num_scheduler_steps
    if args.tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    return kwargs


def speculative_kwargs_of(args) -> dict:
    """The settings of the `--speculative` entries given on the command line (`system_settings` applies them)."""
    return {name: getattr(args, name) for name in ("num_speculative_tokens", "speculative_model")
            if getattr(args, name) is not None}


def methods_of(field: str, text: str | None, methods: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """`--<field> none,a,b` -> (None, "a", "b"), in the order given, each entry one of `methods` or "none" (None:
    (None,)). Raises ValueError naming `field` for an unknown or repeated entry."""
    if not text:
        return (None,)
    names = [part.strip() for part in text.split(",")]
    allowed = ["none", *(m for m in methods if m is not None)]
    bad = [n for n in names if n not in allowed]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"{field}: a comma-separated list of distinct {allowed}, got {text!r}")
    return tuple(None if n == "none" else n for n in names)


def quantizations_of(text: str | None) -> tuple[str | None, ...]:
    """`--quantization none,int8,fp8` -> (None, "int8", "fp8"), in the order given (None: (None,), the model as
    loaded). Raises ValueError naming quantization for an unknown or repeated entry."""
    return methods_of("quantization", text, QUANTIZATION_METHODS)


def speculatives_of(text: str | None) -> tuple[str | None, ...]:
    """`--speculative none,ngram,draft` -> (None, "ngram", "draft"), in the order given (None: (None,), no
    speculation). Raises ValueError naming speculative for an unknown or repeated entry."""
    return methods_of("speculative", text, SPECULATIVE_METHODS)


def model_config_of(model: str | None, device: torch.device):
    """The HF config of the checkpoint the bench will run: `model`'s, or the default of `device`'s type."""
    from transformers import Qwen3Config

    import minirt
    from minirt.model.loader import load_config, resolve_checkpoint

    if model is None and device.type == "cuda":
        return Qwen3Config(**QWEN3_0_6B)
    return load_config(resolve_checkpoint(model or minirt.DEFAULT_MODEL))


def run(args) -> int:
    """Run `bench`: print the tables, write the JSON report. Exit status 1 if minirt's greedy tokens differ
    from transformers' in float32 (the correctness guard), 2 on bad arguments."""
    device = torch.device(args.device)
    baselines = (() if args.baselines == "none" else tuple(args.baselines.split(",")) if args.baselines
                 else BASELINES[device.type])
    unknown = set(baselines) - {"hf_generate", "hf_generate_batch"}
    if unknown or (device.type == "cuda" and not torch.cuda.is_available()):
        print(f"error: {f'unknown baselines {sorted(unknown)}' if unknown else 'CUDA is not available'}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")     # everything is local: fail fast rather than wait on a network
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = ["throughput", "latency"] if args.workload == "all" else [args.workload]
    engine_kwargs, speculative_kwargs = engine_kwargs_of(args), speculative_kwargs_of(args)
    try:                   # checked before any model is built
        quantizations = quantizations_of(args.quantization)
        speculatives = speculatives_of(args.speculative)
        for name in speculative_kwargs:
            wanted = ("draft",) if name == "speculative_model" else ("ngram", "draft")
            if not set(wanted) & set(speculatives):
                raise ValueError(f"{name}: set, but --speculative names no {' or '.join(map(repr, wanted))} entry")
        model_config = model_config_of(args.model, device)
        for quant in quantizations:
            for drafter in speculatives:
                settings = system_settings(engine_kwargs, quant, args.weight_block_size, drafter, speculative_kwargs)
                resolve_plan(EngineConfig(**settings), device, model_config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = bench(device, workloads, args.quick, args.model, baselines, args.seed, engine_kwargs,
                   args.time_collectives, quantizations, args.weight_block_size, speculatives, speculative_kwargs)
    print(format_report(report))
    switches = [f"{k.replace('_', '-')}-{str(v).lower()}" for k, v in engine_kwargs.items()]  # non-default runs
    if quantizations != (None,):
        switches.append("quant-" + "-".join(str(q).lower() for q in quantizations))
    if speculatives != (None,):
        switches.append("spec-" + "-".join(str(d).lower() for d in speculatives))
    switches += [f"{k.replace('_', '-')}-{v}" for k, v in speculative_kwargs.items() if k != "speculative_model"]
    parts = [device.type, "quick" if args.quick else "", "" if args.workload == "all" else args.workload,
             *switches, str(datetime.date.today())]
    write_report(report, args.out, args.name or "-".join(p for p in parts if p))
    correctness = report.get("correctness")
    if (report["settings"]["dtype"] == "float32" and correctness is not None and correctness["system"] == "minirt"
            and correctness["exact_match"] < 1):
        print("FAIL: minirt's greedy tokens differ from transformers' in float32", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirt.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
