"""Chapter 08: an OpenAI-compatible HTTP server over the asyncio engine (`python -m minirt serve`).

    protocol.py   OpenAI's request models, responses and stream chunks (pydantic); fields honoured or refused
    limits.py     limits on every connection: body size, read timeouts, keep-alive, open connections
    app.py        the FastAPI routes, admission (429/503), disconnects, SSE (sse-starlette)
    metrics.py    GET /metrics: TTFT/TPOT/e2e histograms, queue and KV gauges (prometheus_client)
    shutdown.py   uvicorn's graceful shutdown with a drain deadline
    server.py     the command line: load, serve, exit
    bench.py      `python -m minirt bench-serve`: Poisson arrivals over HTTP, TTFT/TPOT/ITL, goodput

The server sits around the engine, not inside it: it uses `Engine.validate`, `submit`, `abort` and `stats`
only, on the event loop uvicorn runs. Needs the `serve` extra (`pip install -e ".[serve]"`).
"""
