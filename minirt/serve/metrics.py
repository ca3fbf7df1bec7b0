"""Chapter 08: what the server exports at GET /metrics, in Prometheus' text format (`prometheus_client`).

Names are vLLM's (vllm/v1/metrics/loggers.py) with minirt's prefix where the meaning is the same
(`vllm:time_to_first_token_seconds` -> `minirt:time_to_first_token_seconds`); README.md's table maps them all.

    counted per engine step     minirt:prompt_tokens_total (a request's prompt, at its first token),
                                minirt:generation_tokens_total
    per finished request        minirt:time_to_first_token_seconds, minirt:inter_token_latency_seconds,
                                minirt:request_time_per_output_token_seconds, minirt:e2e_request_latency_seconds
                                (histograms, seconds from the request's arrival at the front end),
                                minirt:request_success_total{finished_reason}
    read at each scrape         minirt:num_requests_running (admitted: prefilling or decoding), _waiting,
                                minirt:num_requests_prefilling, minirt:kv_cache_usage_perc, minirt:kv_blocks_used,
                                minirt:kv_blocks_total, minirt:num_preemptions_total, minirt:prefix_cache_queries_total,
                                minirt:prefix_cache_hits_total (tokens), from `engine.stats()`
    at the front door           minirt:requests_rejected_total{reason} (429 and 503 before the engine)

Each server has its own registry, so two servers in one process (the tests) do not share counters. With
several front-end processes (`--api-server-count N`) each counts what it serves in prometheus_client's
multiprocess mode (one memory-mapped file per process, summed at each scrape, as vLLM does with N API servers),
and the gauges come from the engine core's stats, which every front end receives: any front end answers
for all of them.
"""

from __future__ import annotations

import os
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minirt.request import RequestOutput

#: Histogram buckets in seconds: from a fast GPU decode step (1 ms) to a long queue on a CPU (80 s), as vLLM's.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Gauges and counters read from `engine.stats()` when Prometheus scrapes (nothing to keep in sync)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        used = s["num_total_blocks"] - s["num_free_blocks"]
        for name, value, what in (
                ("num_requests_waiting", s["num_waiting"], "requests in the waiting queue"),
                ("num_requests_running", s["num_prefilling"] + s["num_running"], "requests admitted (KV blocks held)"),
                ("num_requests_prefilling", s["num_prefilling"], "of the running requests, those with prompt left"),
                ("kv_cache_usage_perc", used / max(s["num_total_blocks"], 1), "fraction of KV blocks in use (0-1)"),
                ("kv_blocks_used", used, "KV blocks held by requests (cached free blocks not counted)"),
                ("kv_blocks_total", s["num_total_blocks"], "KV blocks in the pool")):
            yield GaugeMetricFamily(f"minirt:{name}", what, value=value)
        for name, key, what in (("num_preemptions", "num_preemptions", "requests preempted (blocks freed, recomputed)"),
                                ("prefix_cache_queries", "prefix_cache_queries", "prompt tokens looked up"),
                                ("prefix_cache_hits", "prefix_cache_hits", "prompt tokens found in the prefix cache")):
            yield CounterMetricFamily(f"minirt:{name}", what, value=s[key])


class ServerMetrics:
    """The registry of one server. `count_step` counts tokens per engine step (the app makes it a step callback
    of the engine, or of the `EngineClient`); `observe(output)` records a finished request; `render()` is the page."""

    def __init__(self, engine):
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        self.engine_collector = EngineCollector(engine)
        self.registry = registry = CollectorRegistry()
        registry.register(self.engine_collector)

        def histogram(name, what):
            return Histogram(f"minirt:{name}", what, buckets=LATENCY_BUCKETS, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "arrival at the front end -> first output token")
        self.itl = histogram("inter_token_latency_seconds", "gap between consecutive output tokens")
        self.tpot = histogram("request_time_per_output_token_seconds", "mean gap between output tokens, per request")
        self.e2e = histogram("e2e_request_latency_seconds", "arrival at the front end -> finished")
        self.prompt_tokens = Counter("minirt:prompt_tokens", "prompt tokens prefilled", registry=registry)
        self.generation_tokens = Counter("minirt:generation_tokens", "tokens generated", registry=registry)
        self.requests = Counter("minirt:request_success", "finished requests", ["finished_reason"], registry=registry)
        self.rejected = Counter("minirt:requests_rejected", "requests refused before reaching the engine",
                                ["reason"], registry=registry)
        self._counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # request -> output tokens counted

    def count_step(self, engine, batch) -> None:
        """After each step: the tokens each request of `batch` gained, and the prompts that got a first token."""
        for request, _ in batch.items:
            counted, n = self._counted.get(request, 0), request.num_output_tokens
            if n > counted:
                if counted == 0:
                    self.prompt_tokens.inc(request.num_prompt_tokens)
                self.generation_tokens.inc(n - counted)
                self._counted[request] = n

    def observe(self, output: RequestOutput) -> None:
        m = output.metrics
        for histogram, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if value is not None:
                histogram.observe(value)
        for before, after in zip(m.token_times_s, m.token_times_s[1:]):
            self.itl.observe(after - before)
        self.requests.labels(output.finish_reason or "none").inc()

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.engine_collector)
        return generate_latest(registry)
