"""Run-level serving metrics from per-request ones (definitions as in vLLM's benchmark_serving).

TTFT: arrival -> first output token. TPOT: mean gap between output tokens after the first, per request.
Throughput: all output tokens / wall time of the run. Percentiles are linear interpolations (p50 = median).
"""

from __future__ import annotations

import statistics

from minirt.request import RequestOutput


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if 1 <= q <= 99 else (
        min(values) if q < 1 else max(values))


def summarize(outputs: list[RequestOutput], wall_time_s: float) -> dict:
    """Per-run figures: requests, output tokens, output tokens/s, TTFT/TPOT/e2e p50 and p99 (seconds)."""
    ttft = [o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None]
    tpot = [o.metrics.tpot_s for o in outputs if o.metrics.tpot_s is not None]
    e2e = [o.metrics.e2e_s for o in outputs if o.metrics.e2e_s is not None]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "num_requests": len(outputs),
        "output_tokens": tokens,
        "wall_time_s": wall_time_s,
        "output_tokens_per_s": tokens / wall_time_s if wall_time_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
    }


def format_table(header: list[str], rows: list[list]) -> str:
    """A plain-text table, numbers right-aligned (floats with 4 significant digits)."""
    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    cells = [[cell(x) for x in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    for r, raw in zip(cells, rows):
        lines.append("  ".join(c.rjust(w) if isinstance(x, (int, float)) else c.ljust(w)
                               for c, w, x in zip(r, widths, raw)))
    return "\n".join(lines)
