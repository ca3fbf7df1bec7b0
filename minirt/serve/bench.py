"""Online benchmark: `python -m minirt bench-serve` - Poisson arrivals over HTTP, streamed, at several rates.

As vLLM's serving benchmark (benchmarks/benchmark_serving.py): requests arrive as a Poisson process of rate
`lambda` (exponential gaps, seeded), each one a streamed `/v1/completions` call with random token ids as its
prompt, greedy, EOS ignored, so every request generates exactly `output_len` tokens. Measured at the client:

* TTFT: send -> first streamed text. TPOT: (last text - first text) / (tokens - 1), per request.
* ITL (inter-token latency): the gaps between consecutive streamed chunks, pooled over all requests.
* throughput: requests/s and output tokens/s over the run (first send -> last answer).
* goodput: requests/s that met both SLOs, TTFT <= `ttft_slo_s` and TPOT <= `tpot_slo_s` (DistServe,
  Zhong et al. 2024, section 2): the throughput that counts.
* Little's law (L = lambda W): the requests in the server, sampled from its /metrics gauges during the run,
  against the arrival rate times the mean time in the system measured at the client.

Without `--url` it starts `python -m minirt serve` itself (the embedded model on the CPU; on CUDA a
Qwen3-0.6B-shaped checkpoint with random weights, as `python -m minirt bench` builds it) and stops it after.
It prints a table, writes JSON (with the commit measured) and a latency-throughput plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import subprocess
import sys
import tempfile
import time

from minirt.bench import commit
from minirt.metrics import format_table, percentile
from minirt.parallel.workers import free_port


# ============================================================================ one run


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` requests/s (the first at 0)."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s, got {rate!r}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def stream_one(client, model: str, prompt: list[int], output_len: int) -> dict:
    """One streamed completion; returns its client-side timings (seconds from its send)."""
    start = time.perf_counter()
    chunk_times, tokens, error = [], None, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunk_times.append(time.perf_counter() - start)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:                    # noqa: BLE001 - a failed request is a result, counted as such
        error = f"{type(e).__name__}: {e}"
    e2e = time.perf_counter() - start
    ok = error is None and bool(chunk_times) and tokens is not None
    return {"ok": ok, "error": error, "e2e_s": e2e, "output_tokens": tokens or 0,
            "ttft_s": chunk_times[0] if ok else None,
            "tpot_s": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if ok and tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])]}


def goodput(results: list[dict], duration_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Requests per second that succeeded within both SLOs: TTFT <= ttft_slo_s and TPOT <= tpot_slo_s (a
    request of one token has no TPOT and meets that SLO). `results`: dicts with "ok", "ttft_s", "tpot_s"."""
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s!r}")
    good = [r for r in results if r["ok"] and r["ttft_s"] <= ttft_slo_s
            and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo_s)]
    return len(good) / duration_s


async def sample_in_flight(url: str, stop: asyncio.Event, every_s: float = 0.05) -> list[float]:
    """Requests in the server (waiting + running, running counting the prefilling ones, from GET /metrics) every
    `every_s` seconds."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"minirt:num_requests_waiting", "minirt:num_requests_running"}
    samples = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            text = (await http.get("/metrics")).text
            samples.append(sum(s.value for fam in text_string_to_metric_families(text) if fam.name in names
                               for s in fam.samples))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return samples


def summarize_run(results: list[dict], rate: float, duration_s: float, ttft_slo_s: float, tpot_slo_s: float,
                  in_flight: list[float]) -> dict:
    """The figures of one rate (seconds, requests/s, tokens/s)."""
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
    # Little's law, L = lambda W: the requests in the server (sampled from its gauges) against the arrival rate
    # of the run (requests / duration, which is also its throughput) times the mean time in the system
    fig["little"] = {"mean_in_flight": sum(in_flight) / len(in_flight) if in_flight else None,
                     "rate_x_mean_e2e": fig["request_throughput"] * fig["e2e_mean_s"] if e2e else None,
                     "num_samples": len(in_flight)}
    return fig


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """Send `prompts` at Poisson times of `rate`, all streamed; returns `summarize_run`'s figures."""
    from openai import AsyncOpenAI

    arrivals = poisson_arrivals(len(prompts), rate, seed)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_in_flight(url, stop))
        start = time.perf_counter()

        async def at(t, prompt):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await stream_one(client, model, prompt, output_len)

        results = await asyncio.gather(*(at(t, p) for t, p in zip(arrivals, prompts)))
        duration = time.perf_counter() - start
        stop.set()
        in_flight = await sampler
    return summarize_run(list(results), rate, duration, ttft_slo_s, tpot_slo_s, in_flight)


async def bench_serve(url: str, rates: list[float], num_requests: int, prompt_len: tuple[int, int], output_len: int,
                      ttft_slo_s: float, tpot_slo_s: float, seed: int = 0, warmup: int = 4) -> dict:
    """Run every rate against the server at `url` (same prompts each time); returns {"model", "results"}."""
    import httpx

    from minirt.bench import make_prompts

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
    vocab = int(card.get("vocab_size") or 0) or _vocab_of(card["root"])
    prompts = make_prompts(num_requests, prompt_len, vocab, seed)
    if warmup:
        await run_rate(url, card["id"], prompts[:warmup], min(output_len, 8), 1e6, seed, ttft_slo_s, tpot_slo_s)
    results = [await run_rate(url, card["id"], prompts, output_len, rate, seed + i, ttft_slo_s, tpot_slo_s)
               for i, rate in enumerate(rates)]
    return {"model": card, "results": results}


def _vocab_of(path: str) -> int:
    from minirt.model.loader import load_config

    return load_config(path).vocab_size


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
    keys = ["rate", "completed", "request_throughput", "output_throughput", "goodput", "ttft_p50_s", "ttft_p99_s",
            "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s"]
    rows = [[r[k] for k in keys] + [r["little"]["mean_in_flight"], r["little"]["rate_x_mean_e2e"]] for r in results]
    return format_table(["rate req/s", "done", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50",
                         "TPOT p99", "ITL p50", "ITL p99", "L (server)", "lambda W"], rows)


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
    p.add_argument("--rates", type=_floats, default=None, help="arrival rates in requests/s, comma-separated")
    p.add_argument("--num-requests", type=int, default=None, help="requests per rate")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds (goodput's TTFT bound)")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds (goodput's TPOT bound)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--name", default=None, help="file name of the JSON and PNG (default serve-<device>-<date>)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    return p


def run(args) -> int:
    import torch

    from minirt import DEFAULT_MODEL
    from minirt.bench import QWEN3_0_6B, build_random_qwen3, environment, write_report

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rates, num, plen, olen, ttft_slo, tpot_slo = WORKLOADS[device]
    rates = args.rates or rates
    num, olen = args.num_requests or num, args.output_len or olen
    plen = tuple(args.prompt_len) if args.prompt_len else plen
    ttft_slo, tpot_slo = args.ttft_slo or ttft_slo, args.tpot_slo or tpot_slo
    if num < 1 or olen < 1 or not all(r > 0 for r in rates) or not 1 <= plen[0] <= plen[1]:
        print("error: --num-requests, --output-len must be >= 1, --rates > 0, 1 <= MIN <= MAX", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    measured = commit()                 # before the run: the tree may change while it runs
    proc, server_args = None, list(args.server_arg)
    with tempfile.TemporaryDirectory() as tmp:
        model_info = {"path": args.model}
        try:
            if args.url is None:
                model = args.model
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
                proc, url = start_server(model, device, server_args)
            else:
                url = args.url.rstrip("/")
            report = asyncio.run(bench_serve(url, rates, num, plen, olen, ttft_slo, tpot_slo, args.seed))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    dev, versions = environment(torch.device(device))
    report = {"commit": measured, "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": dev,
              "versions": versions, "server": {"url": args.url, "started": args.url is None, "args": server_args},
              "model": {**model_info, "served": report["model"]},
              "settings": {"rates": rates, "num_requests": num, "prompt_len": list(plen), "output_len": olen,
                           "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "seed": args.seed,
                           "arrivals": "Poisson", "stream": True, "greedy": True, "ignore_eos": True},
              "results": report["results"]}
    print(format_results(report["results"]))
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
