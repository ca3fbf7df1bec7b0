"""Chapter 08: an OpenAI-compatible HTTP server over the asyncio engine (`python -m minirt serve`).

    protocol.py   OpenAI's request models, responses and stream chunks (pydantic); fields honoured or refused
    limits.py     limits on every connection: body size, read timeouts, keep-alive, open connections
    app.py        the FastAPI routes, admission (429/503), disconnects, SSE (sse-starlette)
    core.py       the engine-core process: an `Engine` whose steps run in a plain loop behind a ZMQ socket
    client.py     the front end's `EngineClient`: tokenizer, validation, detokenizer, stop strings; msgpack over ZMQ
    metrics.py    GET /metrics: vLLM's names with a `minirt:` prefix (prometheus_client)
    shutdown.py   uvicorn's graceful shutdown with a drain deadline
    server.py     the command line: the processes, serve, drain, exit
    bench.py      `python -m minirt bench-serve`: Poisson arrivals over HTTP, TTFT/TPOT/ITL, goodput

The server sits around the engine, not inside it: the app uses `validate`, `submit`, `abort`, `stats` and
`step_callbacks` only, of an `Engine` on its own event loop (`--in-process`) or of an `EngineClient` whose engine
core is another process (the default). Needs the `serve` extra (`pip install -e ".[serve]"`).
"""
