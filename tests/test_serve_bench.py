"""The online benchmark (`minirt.serve.bench`, `python -m minirt bench-serve`) and its lean client.

Oracles: `minirt.LLM.generate` on the same token-id prompts and sampling (itself checked against transformers in
test_equality.py) for the streamed text and token counts; the server's own non-streamed answer (its `usage`);
hand-written HTTP bodies with known payloads for the SSE reader; closed-form values for the arrival times and the
batch-means standard error. The server runs the embedded model on the CPU, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import minirt
from minirt.bench import make_prompts
from minirt.serve import bench
from minirt.serve.bench_client import sse_data, stream_one
from minirt.serve.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[1]


def test_lean_client_text_and_tokens_equal_llm_generate_and_the_servers_usage(default_model, default_llm):
    prompts = make_prompts(4, (8, 24), 4096, seed=3)
    want = default_llm.generate(prompts, minirt.SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine = minirt.Engine(default_model, device="cpu", dtype="float32")
    with BackgroundServer(engine) as url:
        got = asyncio.run(_all(url, prompts, 12))
        plain = [httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json() for p in prompts]
    for g, w, p in zip(got, want, plain):
        assert g["ok"], g["error"]
        assert g["text"] == w.text == p["choices"][0]["text"]
        assert g["output_tokens"] == len(w.token_ids) == p["usage"]["completion_tokens"] == 12
        assert g["finish_reason"] == "length"
        assert len(g["itl_s"]) >= 1 and g["ttft_s"] > 0 and g["tpot_s"] > 0


async def _all(url, prompts, n):
    return await asyncio.gather(*(stream_one(url, "default_model", p, n) for p in prompts))


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_sse_reader_yields_every_data_line_of_either_framing(framing):
    events = [b'{"a": 1}', b'{"b": "x\\ny"}', b"[DONE]"]
    body = b"".join(b"data: " + e + b"\r\n\r\n" for e in events) + b": a comment\r\n\r\n"
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]        # lines split across reads and chunks

    async def handle(reader, writer):
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        await reader.readexactly(2)                                    # the body: {}
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for p in pieces:
                writer.write(b"%x\r\n%s\r\n" % (len(p), p))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for p in pieces:
                writer.write(p)
                await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return [d async for d in sse_data("127.0.0.1", port, "/v1/completions", {})]

    assert asyncio.run(main()) == events


def test_sse_reader_names_the_status_of_a_refusal():
    async def handle(reader, writer):
        await reader.read(1000)
        writer.write(b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 17\r\n\r\n{"error": "full"}')
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            return await stream_one(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "m", [1, 2], 4)

    r = asyncio.run(main())
    assert not r["ok"] and "HTTP 429" in r["error"] and "full" in r["error"]


def test_arrivals_and_the_standard_error_of_a_sampled_mean():
    assert bench.poisson_arrivals(5, math.inf, 0) == [0.0] * 5
    gaps = [b - a for a, b in zip(*(lambda t: (t, t[1:]))(bench.poisson_arrivals(20000, 50.0, 1)))]
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.001               # mean gap 1/rate, 3 sigma is 0.0004
    assert bench.mean_and_stderr([3.0] * 40) == (3.0, 0.0)
    # ten batches of four, batch means 0, 1, ..., 9: mean 4.5, stderr = stdev(0..9) / sqrt(10)
    mean, se = bench.mean_and_stderr([float(i) for i in range(10) for _ in range(4)])
    assert mean == 4.5 and se == pytest.approx(math.sqrt(sum((i - 4.5) ** 2 for i in range(10)) / 9 / 10))
    assert bench.mean_and_stderr([1.0, 2.0, 3.0]) == (2.0, None)     # too few samples for a spread


def test_scrape_reads_minirt_and_vllm_metric_names():
    page = ("# TYPE {p}num_requests_waiting gauge\n{p}num_requests_waiting 2.0\n"
            "# TYPE {p}num_requests_running gauge\n{p}num_requests_running 3.0\n"
            "# TYPE {p}num_requests_prefilling gauge\n{p}num_requests_prefilling 1.0\n"   # counted in running
            "# TYPE {p}e2e_request_latency_seconds histogram\n"
            '{p}e2e_request_latency_seconds_bucket{{le="+Inf"}} 4.0\n'
            "{p}e2e_request_latency_seconds_count 4.0\n{p}e2e_request_latency_seconds_sum 6.5\n")
    for prefix in ("minirt:", "vllm:"):
        assert bench._scrape(page.format(p=prefix)) == (5.0, 4.0, 6.5)


@pytest.mark.slow
def test_bench_serve_two_client_processes_and_compare_offline_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "minirt", "bench-serve", "--device", "cpu", "--rates", "16,inf",
           "--num-requests", "6", "--prompt-len", "8", "16", "--output-len", "6", "--client-processes", "2",
           "--compare-offline", "--out", str(tmp_path), "--name", "run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "client CPU" in proc.stdout and "vs offline" in proc.stdout
    report = json.loads((tmp_path / "run.json").read_text())
    assert (tmp_path / "run.png").is_file()
    assert report["commit"] and report["settings"]["client_processes"] == 2
    assert report["offline"]["output_tokens"] == 6 * 6 and report["offline"]["finish_reasons"] == ["length"]
    assert [r["rate"] for r in report["results"]] == [16, math.inf]
    for r in report["results"]:
        assert r["completed"] == 6 and r["output_throughput"] * r["duration_s"] == pytest.approx(36)
        assert r["client"]["processes"] == 2 and len(r["client"]["cpu_share"]) == 2
        assert all(0 < s < 2 for s in r["client"]["cpu_share"]), r["client"]
        # greedy on the CPU in float32: the streamed texts equal LLM.generate's on the same mix
        assert r["vs_offline"]["texts_equal"] == r["vs_offline"]["texts"] == 6
        assert r["vs_offline"]["output_throughput_ratio"] == pytest.approx(
            r["output_throughput"] / report["offline"]["output_throughput"])
        assert r["little"]["num_samples"] >= 1 and r["little"]["rate_x_engine_e2e"] > 0
