"""Online benchmark: `python -m minirt bench-serve` - Poisson arrivals over HTTP, streamed, at several rates.

As vLLM's serving benchmark (benchmarks/benchmark_serving.py): requests arrive as a Poisson process of rate
`lambda` (exponential gaps, seeded; `inf` sends them all at once), each one a streamed `/v1/completions` call
with random token ids as its prompt, greedy, EOS ignored, so every request generates exactly `output_len`
tokens. Measured at the client:

* TTFT: send -> first streamed text. TPOT: (last text - first text) / (tokens - 1), per request.
* ITL (inter-token latency): the gaps between consecutive streamed chunks, pooled over all requests.
* throughput: requests/s and output tokens/s over the run (first send -> last answer).
* goodput: requests/s that met both SLOs, TTFT <= `ttft_slo_s` and TPOT <= `tpot_slo_s` (DistServe,
  Zhong et al. 2024, section 2): the throughput that counts.
* Little's law (L = lambda W): the requests in the engine, sampled from the server's /metrics gauges during the
  run (with the standard error of their mean), against the arrival rate times the mean time in the engine (the
  server's e2e histogram) and times the mean time in the system as the client measured it.
* the client's CPU share: CPU seconds of each client process over the wall time of the rate. A client near one
  core measures itself, not the server.

The client is lean: one HTTP/1.1 connection per request over asyncio streams, the body's `data:` lines parsed
with `json.loads` and nothing else (no SDK objects on the hot path). `client_processes > 1` splits the requests
of every rate round-robin over that many processes, each with its own event loop, started once and released
together at each rate; the arrival times are those of the one Poisson process. `--compare-offline` runs the same
prompts with the same sampling through `LLM.generate` in a child process of the same run (before the server
starts, so each has the device to itself) and reports online / offline output tokens/s.

Without `--url` it starts `python -m minirt serve` itself (the embedded model on the CPU; on CUDA a
Qwen3-0.6B-shaped checkpoint with random weights, as `python -m minirt bench` builds it) and stops it after.
It prints a table, writes JSON (with the commit measured) and a latency-throughput plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time

from minirt.bench import commit
from minirt.metrics import format_table, percentile
from minirt.parallel.workers import free_port
from minirt.serve.bench_client import send_all, stream_one  # noqa: F401 - stream_one: one request, for callers


# ============================================================================ the client processes


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` requests/s (the first at 0);
    `rate = inf` sends every request at 0."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s, got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


class ClientProcesses:
    """`n` client processes (`python -P minirt/serve/bench_client.py`: a lean interpreter each, without torch), started
    once; at each rate every one gets its share of the requests and the same start time."""

    def __init__(self, n: int):
        from minirt.serve import bench_client as client

        self.procs = [subprocess.Popen([sys.executable, "-P", client.__file__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in range(n)]

    async def send(self, url: str, model: str, jobs: list, output_len: int) -> list[dict]:
        """Round-robin `jobs` over the processes; returns each process's `send_all` answer once all are in."""
        n = len(self.procs)
        start_at = time.monotonic() + 0.3          # CLOCK_MONOTONIC: one clock for every process of the machine
        for k, proc in enumerate(self.procs):
            proc.stdin.write(json.dumps({"url": url, "model": model, "jobs": jobs[k::n], "output_len": output_len,
                                         "start_at": start_at}) + "\n")
            proc.stdin.flush()
        lines = await asyncio.gather(*(asyncio.to_thread(proc.stdout.readline) for proc in self.procs))
        if not all(lines):
            raise RuntimeError("a client process ended without answering")
        return [json.loads(line) for line in lines]

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# ============================================================================ one rate


def goodput(results: list[dict], duration_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Requests per second that succeeded within both SLOs: TTFT <= ttft_slo_s and TPOT <= tpot_slo_s (a
    request of one token has no TPOT and meets that SLO). `results`: dicts with "ok", "ttft_s", "tpot_s"."""
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s!r}")
    good = [r for r in results if r["ok"] and r["ttft_s"] <= ttft_slo_s
            and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo_s)]
    return len(good) / duration_s


def _scrape(text: str) -> tuple[float, float, float]:
    """(requests in the engine, e2e histogram count, e2e histogram sum) from a /metrics page. Families are
    matched by the end of their names, so `minirt:...` and vLLM's `vllm:...` names both read."""
    from prometheus_client.parser import text_string_to_metric_families

    inside, count, total = 0.0, 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith(("num_requests_waiting", "num_requests_running")):   # running counts the prefilling
            inside += sum(s.value for s in fam.samples)
        elif fam.name.endswith("e2e_request_latency_seconds"):
            for s in fam.samples:
                if s.name.endswith("_count"):
                    count += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
    return inside, count, total


async def sample_engine(url: str, ready: asyncio.Event, stop: asyncio.Event, every_s: float = 0.05) -> dict:
    """Poll GET /metrics every `every_s` seconds (`ready` is set after the first) until `stop`, then once more:
    {"in_flight": (time.monotonic(), requests in the engine) at each poll, "e2e_count", "e2e_sum": what the
    server's e2e histogram gained meanwhile}."""
    import httpx

    samples, first, last = [], None, None
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while True:
            stopping = stop.is_set()
            inside, count, total = _scrape((await http.get("/metrics")).text)
            first = first or (count, total)
            last = (count, total)
            if stopping:
                break
            samples.append((time.monotonic(), inside))
            ready.set()
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return {"in_flight": samples, "e2e_count": last[0] - first[0], "e2e_sum": last[1] - first[1]}


def mean_and_stderr(samples: list[float], batches: int = 10) -> tuple[float | None, float | None]:
    """Mean of a time series and its standard error by batch means (consecutive samples are correlated, so the
    plain sigma / sqrt(n) would be too small): the samples in `batches` runs, the spread of the runs' means."""
    if not samples:
        return None, None
    mean = sum(samples) / len(samples)
    k = min(batches, len(samples) // 2)
    if k < 2:
        return mean, None
    size = len(samples) // k
    means = [sum(samples[i * size:(i + 1) * size]) / size for i in range(k)]
    var = sum((m - mean) ** 2 for m in means) / (k - 1)
    return mean, math.sqrt(var / k)


def summarize_run(results: list[dict], rate: float, duration_s: float, ttft_slo_s: float, tpot_slo_s: float,
                  engine: dict, clients: list[dict]) -> dict:
    """The figures of one rate (seconds, requests/s, tokens/s). `engine`: `sample_engine`'s answer; `clients`:
    each client process's `send_all` answer (its "cpu_s" and "wall_s")."""
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    itl = [g for r in ok for g in r["itl_s"]]
    e2e = [r["e2e_s"] for r in ok]
    fig = {"rate": rate, "num_requests": len(results), "completed": len(ok), "duration_s": duration_s,
           "request_throughput": len(ok) / duration_s, "output_throughput": sum(r["output_tokens"] for r in ok) / duration_s,
           "goodput": goodput(results, duration_s, ttft_slo_s, tpot_slo_s),
           "errors": [r["error"] for r in results if r["error"]][:3]}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        fig[f"{name}_p50_s"], fig[f"{name}_p99_s"] = percentile(values, 50), percentile(values, 99)
        fig[f"{name}_mean_s"] = sum(values) / len(values) if values else None
    # Little's law, L = lambda W, over the run [first send, last answer]: lambda = requests / duration. L is the
    # time average of the requests in the engine; the engine's W (its e2e histogram) should give the same product
    # within the sampling noise, the client's W also counts the time outside the engine (HTTP, the client)
    mean, stderr = mean_and_stderr(engine["in_flight"])
    w_engine = engine["e2e_sum"] / engine["e2e_count"] if engine["e2e_count"] else None
    fig["little"] = {"mean_in_flight": mean, "mean_in_flight_stderr": stderr, "num_samples": len(engine["in_flight"]),
                     "rate_x_mean_e2e": fig["request_throughput"] * fig["e2e_mean_s"] if e2e else None,
                     "rate_x_engine_e2e": fig["request_throughput"] * w_engine if w_engine is not None else None}
    fig["client"] = {"processes": len(clients), "cpu_share": [c["cpu_s"] / c["wall_s"] for c in clients],
                     "cpu_s": [c["cpu_s"] for c in clients], "wall_s": [c["wall_s"] for c in clients]}
    return fig


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   ttft_slo_s: float, tpot_slo_s: float, clients: ClientProcesses | None = None,
                   requests: list | None = None) -> dict:
    """Send `prompts` at Poisson times of `rate`, all streamed, from this event loop (its thread's CPU time is the
    client's) or from `clients`; returns `summarize_run`'s figures. `requests`, if given, receives every request's
    result (`stream_one`'s: timings, text, tokens), in prompt order."""
    jobs = list(zip(range(len(prompts)), poisson_arrivals(len(prompts), rate, seed), prompts))
    ready, stop = asyncio.Event(), asyncio.Event()
    sampler = asyncio.create_task(sample_engine(url, ready, stop))
    waiter = asyncio.create_task(ready.wait())     # the sampler's first scrape is the histogram's baseline
    await asyncio.wait([sampler, waiter], return_when=asyncio.FIRST_COMPLETED)
    if sampler.done():                             # it failed before its first sample: say why
        waiter.cancel()
        sampler.result()
    if clients is None:
        answers = [await send_all(url, model, jobs, output_len)]
    else:
        answers = await clients.send(url, model, jobs, output_len)
    duration = max(a["wall_s"] for a in answers)   # from the common start time to the last answer
    stop.set()
    engine = await sampler
    t0 = min(a["started_at"] for a in answers)     # L over the run's own window, as lambda and W are
    engine["in_flight"] = [v for t, v in engine["in_flight"] if t0 <= t <= t0 + duration]
    merged = {i: r for a in answers for i, r in a["results"]}
    results = [merged[i] for i in range(len(prompts))]
    if requests is not None:
        requests[:] = results
    return summarize_run(results, rate, duration, ttft_slo_s, tpot_slo_s, engine, answers)


async def bench_serve(url: str, rates: list[float], num_requests: int, prompt_len: tuple[int, int], output_len: int,
                      ttft_slo_s: float, tpot_slo_s: float, seed: int = 0, warmup: int = 4,
                      client_processes: int = 1) -> dict:
    """Run every rate against the server at `url` (same prompts each time); returns {"model", "prompts",
    "results", "requests"}: the card of /v1/models, the prompts (token ids), the figures of each rate and, per
    rate, every request's result (its TTFT, text, ...). `client_processes` 1 sends from this event loop, more
    from that many client processes."""
    import httpx

    from minirt.bench import make_prompts

    if client_processes < 1:
        raise ValueError(f"client_processes: must be >= 1, got {client_processes!r}")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
    vocab = int(card.get("vocab_size") or 0) or _vocab_of(card["root"])
    prompts = make_prompts(num_requests, prompt_len, vocab, seed)
    clients = ClientProcesses(client_processes) if client_processes > 1 else None
    try:
        if warmup:
            await run_rate(url, card["id"], prompts[:max(warmup, client_processes)], min(output_len, 8), math.inf,
                           seed, ttft_slo_s, tpot_slo_s, clients)
        results, requests = [], []
        for i, rate in enumerate(rates):
            requests.append([])
            results.append(await run_rate(url, card["id"], prompts, output_len, rate, seed + i, ttft_slo_s,
                                          tpot_slo_s, clients, requests[-1]))
    finally:
        if clients is not None:
            clients.close()
    return {"model": card, "prompts": prompts, "results": results, "requests": requests}


def _vocab_of(path: str) -> int:
    from minirt.model.loader import load_config

    return load_config(path).vocab_size


# ============================================================================ the same mix offline


def offline_generate(model: str, prompts: list[list[int]], output_len: int, settings: dict,
                     threads: int | None = None, warmup: int = 4) -> dict:
    """`LLM.generate` on `prompts` with the benchmark's sampling (greedy, `output_len` tokens, EOS ignored), all
    submitted at once after a short warm-up; returns its figures (seconds, tokens/s) and texts."""
    import torch

    from minirt import LLM, SamplingParams
    from minirt.metrics import summarize

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model, **settings)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    if warmup:
        llm.generate(prompts[:warmup], SamplingParams(max_new_tokens=min(output_len, 8), ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    s = summarize(outs, wall)
    return {"duration_s": wall, "num_requests": len(outs), "output_tokens": s["output_tokens"],
            "output_throughput": s["output_tokens"] / wall, "request_throughput": len(outs) / wall,
            "ttft_p50_s": s["ttft_p50_s"], "tpot_p50_s": s["tpot_p50_s"],
            "finish_reasons": sorted({o.finish_reason for o in outs}), "texts": [o.text for o in outs]}


def offline_in_child(*args, **kwargs) -> dict:
    """`offline_generate` in a spawned process: its model and KV pool are gone when it returns."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(offline_generate, *args, **kwargs).result()


def compare_offline(results: list[dict], texts: list[list[str]], offline: dict) -> None:
    """Add to each rate's figures its output tokens/s over the offline run's and how many of its streamed texts
    equal `LLM.generate`'s (greedy: all of them where the batch mix does not change the numerics)."""
    for fig, run_texts in zip(results, texts):
        fig["vs_offline"] = {"output_throughput_ratio": fig["output_throughput"] / offline["output_throughput"],
                             "texts_equal": sum(a == b for a, b in zip(run_texts, offline["texts"])),
                             "texts": len(run_texts)}


def _settings_of(server_args: list[str]) -> tuple[dict, int | None]:
    """The engine settings and `--threads` in `serve` arguments, for an `LLM` configured as the server is."""
    from minirt.serve.server import add_engine_settings, engine_settings

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=int, default=None)
    add_engine_settings(p)
    args, _ = p.parse_known_args(server_args)
    return engine_settings(args), args.threads


# ============================================================================ a server to measure


def start_server(model: str, device: str | None, extra: list[str], timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`python -m minirt serve` in a subprocess on a free port; returns it and its URL once /health is ok."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "minirt", "serve", "--model", model, "--port", str(port), "--log-level", "warning",
           *(["--device", device] if device else []), *extra]
    log = tempfile.TemporaryFile("w+")         # not a pipe: a server that logs much would block on a full one
    proc = subprocess.Popen(cmd, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def save_id_tokenizer(path: str, vocab_size: int) -> str:
    """Give a checkpoint without a tokenizer (random weights) one that `transformers` loads: token `i` is the word
    `t{i}`, words decode separated by spaces. The server answers text, so it needs one; no download is needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(path)
    return path


# ============================================================================ report


def format_results(results: list[dict]) -> str:
    """One row per rate: throughput, goodput, latency percentiles (s), Little's law, the client's CPU share (the
    busiest client process, in cores) and, after `compare_offline`, output tokens/s as a share of offline."""
    keys = ["rate", "completed", "request_throughput", "output_throughput", "goodput", "ttft_p50_s", "ttft_p99_s",
            "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s"]
    header = ["rate req/s", "done", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "ITL p50", "ITL p99", "L (engine)", "lambda W", "client CPU"]
    rows = [[r[k] for k in keys] + [r["little"]["mean_in_flight"], r["little"]["rate_x_mean_e2e"],
                                    max(r["client"]["cpu_share"]) if r.get("client") else None] for r in results]
    if any("vs_offline" in r for r in results):
        header.append("vs offline")
        for row, r in zip(rows, results):
            row.append(r["vs_offline"]["output_throughput_ratio"] if "vs_offline" in r else None)
    return format_table(header, rows)


def plot(results: list[dict], title: str, path: str | None = None):
    """Latency against throughput, one point per arrival rate: TTFT and TPOT p50/p99 (ms) vs output tokens/s."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["output_throughput"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, name in zip(axes, ("ttft", "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [1e3 * (r[f"{name}_{q}_s"] or 0) for r in results], style, label=f"{name.upper()} {q}")
        for r, xi in zip(results, x):
            ax.annotate(f"{r['rate']:g}/s", (xi, 1e3 * (r[f"{name}_p99_s"] or 0)), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


# ============================================================================ command line

#: (rates req/s, requests per rate, (shortest, longest prompt), output tokens, TTFT SLO s, TPOT SLO s)
WORKLOADS = {"cpu": ([4, 16, 64, 128, 256], 48, (16, 64), 32, 0.25, 0.05),
             "cuda": ([8, 32, 128, 512], 128, (100, 1024), 128, 0.25, 0.025)}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench-serve", help="online benchmark: Poisson arrivals over HTTP streaming",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start `python -m minirt serve`)")
    p.add_argument("--model", default=None, help="checkpoint to serve (default: embedded on cpu, random "
                                                 "Qwen3-0.6B on cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where the started server runs")
    p.add_argument("--rates", type=_floats, default=None,
                   help="arrival rates in requests/s, comma-separated; inf sends all at once")
    p.add_argument("--num-requests", type=int, default=None, help="requests per rate")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds (goodput's TTFT bound)")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds (goodput's TPOT bound)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes the requests are split over (default 1: this process's event loop)")
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the same prompts and sampling through LLM.generate (configured as the server, "
                        "from --server-arg) and report online / offline output tokens/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--name", default=None, help="file name of the JSON and PNG (default serve-<device>-<date>)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    return p


def run(args) -> int:
    import torch

    from minirt import DEFAULT_MODEL
    from minirt.bench import QWEN3_0_6B, build_random_qwen3, environment, make_prompts, write_report

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rates, num, plen, olen, ttft_slo, tpot_slo = WORKLOADS[device]
    rates = args.rates or rates
    num, olen = args.num_requests or num, args.output_len or olen
    plen = tuple(args.prompt_len) if args.prompt_len else plen
    ttft_slo, tpot_slo = args.ttft_slo or ttft_slo, args.tpot_slo or tpot_slo
    if num < 1 or olen < 1 or args.client_processes < 1 or not all(r > 0 for r in rates) or not 1 <= plen[0] <= plen[1]:
        print("error: --num-requests, --output-len, --client-processes must be >= 1, --rates > 0, "
              "1 <= MIN <= MAX", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    measured = commit()                 # before the run: the tree may change while it runs
    proc, server_args, offline = None, list(args.server_arg), None
    with tempfile.TemporaryDirectory() as tmp:
        model_info = {"path": args.model}
        try:
            model = args.model
            if args.url is None:
                if model is None and device == "cuda":
                    model = save_id_tokenizer(build_random_qwen3(tmp, torch.device("cuda"), args.seed),
                                              QWEN3_0_6B["vocab_size"])
                    model_info = {"name": "Qwen3-0.6B configuration, random weights", "config": QWEN3_0_6B,
                                  "tokenizer": "word-level, token i = 't{i}' (save_id_tokenizer)"}
                model = model or DEFAULT_MODEL
                model_info.setdefault("path", model)
                # one intra-op thread on a CPU: the client shares the cores, and torch's spinning threads then
                # slow the small model's steps down several times over
                if device == "cpu" and "--threads" not in " ".join(server_args):
                    server_args = ["--threads", "1", *server_args]
            if args.compare_offline:
                # before the server starts, in its own process: each run has the device (and its memory) to itself
                if model is None:
                    print("error: --compare-offline with --url needs --model (the served checkpoint)", file=sys.stderr)
                    return 2
                settings, threads = _settings_of(server_args)
                vocab = _vocab_of(model)
                offline = offline_in_child(model, make_prompts(num, plen, vocab, args.seed), olen,
                                           {"device": device, **settings}, threads)
            if args.url is None:
                proc, url = start_server(model, device, server_args)
            else:
                url = args.url.rstrip("/")
            report = asyncio.run(bench_serve(url, rates, num, plen, olen, ttft_slo, tpot_slo, args.seed,
                                             client_processes=args.client_processes))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    if offline is not None:
        if offline["output_tokens"] != num * olen:
            print(f"FAIL: LLM.generate made {offline['output_tokens']} tokens, not {num} x {olen}", file=sys.stderr)
            return 1
        compare_offline(report["results"], [[r["text"] for r in reqs] for reqs in report["requests"]], offline)
    dev, versions = environment(torch.device(device))
    report = {"commit": measured, "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": dev,
              "versions": versions, "server": {"url": args.url, "started": args.url is None, "args": server_args},
              "model": {**model_info, "served": report["model"]},
              "settings": {"rates": rates, "num_requests": num, "prompt_len": list(plen), "output_len": olen,
                           "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "seed": args.seed,
                           "arrivals": "Poisson", "stream": True, "greedy": True, "ignore_eos": True,
                           "client": "raw HTTP/1.1 over asyncio streams, data: lines parsed with json.loads",
                           "client_processes": args.client_processes},
              "results": report["results"]}
    if offline is not None:
        report["offline"] = {k: v for k, v in offline.items() if k != "texts"}
    print(format_results(report["results"]))
    if offline is not None:
        best = max(report["results"], key=lambda r: r["output_throughput"])
        print(f"\noffline LLM.generate, same {num} requests: {offline['output_throughput']:.1f} output tok/s "
              f"(TTFT p50 {offline['ttft_p50_s']:.3f} s); online at its best ({best['rate']:g} req/s): "
              f"{best['output_throughput']:.1f} tok/s = {best['vs_offline']['output_throughput_ratio']:.2f}x, "
              f"busiest client process at {max(best['client']['cpu_share']):.0%} of a core")
    name = args.name or f"serve-{device}-{datetime.date.today()}"
    write_report(report, args.out, name)
    plot(report["results"], f"minirt serve, {dev['name']}, {num} requests/rate, prompts {plen[0]}-{plen[1]}, "
                            f"{olen} tokens out", os.path.join(args.out, name + ".png"))
    failed = sum(r["num_requests"] - r["completed"] for r in report["results"])
    if failed:
        print(f"FAIL: {failed} requests did not complete: {report['results'][-1]['errors']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m minirt.serve.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(run(parser.parse_args(["bench-serve", *sys.argv[1:]])))
