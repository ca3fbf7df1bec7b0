"""Chapter 08: shutting down without dropping anyone - uvicorn's graceful shutdown with a drain deadline.

uvicorn, on SIGINT/SIGTERM, stops listening, closes idle connections and waits for the requests in flight,
cancelling their handlers after `timeout_graceful_shutdown` (their clients then see a cut connection). minirt
marks the server as draining (new requests on open connections get 503), and `drain_timeout` seconds into the
shutdown aborts whatever the engine still holds: each of those requests ends at once with finish_reason
"abort", so its client gets a complete answer (a last chunk and `data: [DONE]`) before uvicorn's deadline.
Then the app's lifespan stops the engine.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("minirt.serve")


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` that drains `state.engine` for at most `drain_timeout` seconds, then aborts."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    async def shutdown(self, sockets=None):
        engine = self.state.engine
        self.state.draining = True
        logger.info("draining %d requests (up to %.1f s)", len(engine.requests), self.drain_timeout)

        def abort_all():
            for request_id in list(engine.requests):
                engine.abort(request_id, "server shut down")

        timer = asyncio.get_running_loop().call_later(self.drain_timeout, abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
