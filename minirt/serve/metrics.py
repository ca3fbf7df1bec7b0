"""Chapter 08: what the server exports at GET /metrics, in Prometheus' text format (`prometheus_client`).

Per request, observed when it finishes: TTFT, TPOT and end-to-end latency histograms (seconds), prompt and
generated token counters, and requests by finish reason. Read from `engine.stats()` at each scrape: requests
waiting, prefilling and running, KV blocks used and in total, preemptions. Names follow vLLM's
(`vllm:time_to_first_token_seconds` -> `minirt_time_to_first_token_seconds`) with Prometheus' `_` separator.
Each server has its own registry, so two servers in one process (the tests) do not share counters.
"""

from __future__ import annotations

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
        for name, key, what in (("num_requests_waiting", "num_waiting", "requests in the waiting queue"),
                                ("num_requests_prefilling", "num_prefilling", "requests admitted, prompt not done"),
                                ("num_requests_running", "num_running", "requests decoding"),
                                ("kv_blocks_total", "num_total_blocks", "KV blocks in the pool")):
            yield GaugeMetricFamily(f"minirt_{name}", what, value=s[key])
        yield GaugeMetricFamily("minirt_kv_blocks_used", "KV blocks held by requests (cached free blocks not counted)",
                                value=s["num_total_blocks"] - s["num_free_blocks"])
        yield CounterMetricFamily("minirt_num_preemptions", "requests preempted (blocks freed, recomputed later)",
                                  value=s["num_preemptions"])


class ServerMetrics:
    """The registry of one server. `observe(output)` records a finished request; `render()` is the page."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        registry.register(EngineCollector(engine))
        self.ttft = Histogram("minirt_time_to_first_token_seconds", "arrival -> first output token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("minirt_time_per_output_token_seconds", "mean gap between output tokens, per request",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("minirt_e2e_request_latency_seconds", "arrival -> finished",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("minirt_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("minirt_generation_tokens", "tokens generated", registry=registry)
        self.requests = Counter("minirt_requests", "finished requests", ["finish_reason"], registry=registry)
        self.rejected = Counter("minirt_requests_rejected", "requests refused before reaching the engine",
                                ["reason"], registry=registry)

    def observe(self, output: RequestOutput) -> None:
        m = output.metrics
        for histogram, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if value is not None:
                histogram.observe(value)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        self.requests.labels(output.finish_reason or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
