"""The server's own routes, outside the model APIs: /health, /version and /openapi.json."""

from __future__ import annotations

import logging
from importlib import metadata

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loomllm.engine.engine import Engine
from loomllm.protocols.sampling import SamplingParams
from loomllm.server.state import server_state

logger = logging.getLogger(__name__)


async def health(request: Request) -> Response:
    """200 when every running engine computes a token within the health timeout, else 503."""
    state = server_state(request)
    running = state.fleet.running()
    if state.fleet.draining or not running:
        why = "the server is shutting down" if state.fleet.draining else "no model is running"
        return JSONResponse({"status": "unhealthy", "error": why}, status_code=503)
    try:
        with anyio.fail_after(state.health_timeout):
            for served in running:
                await _probe(served.engine)
    except Exception as exc:
        logger.warning("health check failed: %r", exc)
        return JSONResponse({"status": "unhealthy", "error": repr(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> Response:
    try:
        v = metadata.version("loomllm")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


async def openapi(request: Request) -> Response:
    return JSONResponse(server_state(request).openapi)


async def _probe(engine: Engine) -> None:
    """One token of work through `engine` (a pool of it on a pooling model)."""
    if engine.model_info.pooling is not None:
        async with engine.pooled_stream({"prompt_token_ids": [0]}) as stream:
            await anext(stream)
        return
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    async with engine.generate({"prompt_token_ids": [0]}, params) as stream:
        async for _ in stream:
            pass
