"""The OpenAI-compatible HTTP API as a Starlette app over one running Engine.

Routes parse with schemas.py, run with serving.py, stream with sse.py. Every error a
client can cause is a 4xx in OpenAI's error shape; engine failures are 500/503.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocols.sampling import SamplingParams
from runtime.engine import Engine
from runtime.server import serving
from runtime.server.schemas import (
    ApiError,
    bad,
    check_model,
    field,
    parse_chat,
    parse_completion,
)
from runtime.server.sse import EventStreamResponse

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/version")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    return body


async def unless_disconnected(request: Request, run: Callable[[], Awaitable[Any]]) -> Any:
    """`await run()`, cancelled if the client disconnects first (then None is returned).

    Cancellation of run() leaves its RequestStreams, which aborts their requests.
    """
    result: Any = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await run()
        except Exception as exc:  # raised below, outside the task group: no group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def answer(engine: Engine, request: Request, req: Any, model: str) -> Response:
    if req.common.stream:
        return EventStreamResponse(serving.stream(engine, req, model))  # type: ignore[return-value]
    body = await unless_disconnected(request, lambda: serving.complete(engine, req, model))
    if body is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


def build_app(
    engine: Engine, served_model_name: str | None = None, *, api_key: str | None = None,
    health_timeout: float = 10.0,
) -> Starlette:  # fmt: skip
    """An ASGI app serving `engine` under the model name `served_model_name`.

    With `api_key`, every route but /health and /version needs `Authorization: Bearer <key>`.
    """
    model = served_model_name or engine.config.model
    created = int(time.time())

    async def models(request: Request) -> Response:
        card = {"id": model, "object": "model", "created": created, "owned_by": "loomllm",
                "root": engine.config.model, "max_model_len": engine.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> Response:
        body = await read_json(request)
        check_model(body, model)
        return await answer(engine, request, parse_completion(body), model)

    async def chat(request: Request) -> Response:
        body = await read_json(request)
        check_model(body, model)
        return await answer(engine, request, parse_chat(body), model)

    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        check_model(body, model)
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        add_special = field(body, "add_special_tokens", "bool", True)
        if body.get("messages") is not None:
            try:
                text = tokenizer.apply_chat_template(field(body, "messages", "list"))
            except ValueError as exc:
                raise bad(str(exc), "messages") from None
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            text = field(body, "prompt", "str")
            if text is None:
                raise bad("prompt (a string) or messages is required", "prompt")
            ids = tokenizer.encode(text, add_special_tokens=add_special)
        limit = engine.max_model_len
        return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await read_json(request)
        check_model(body, model)
        tokens = field(body, "tokens", "int_list")
        vocab = engine.model_info.vocab_size
        if tokens is None or not all(0 <= t < vocab for t in tokens):
            raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        assert engine.tokenizer is not None
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    async def health(request: Request) -> Response:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            with anyio.fail_after(health_timeout):
                async with engine.generate({"prompt_token_ids": [0]}, params) as stream:
                    async for _ in stream:
                        pass
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

    routes = [
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(chat), methods=["POST"]),
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
        Route("/health", _guard(health), methods=["GET"]),
        Route("/version", _guard(version), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    if api_key is not None:
        return _with_api_key(app, api_key)  # type: ignore[return-value]
    return app


def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                   f"{exc.detail}", None, kind))  # fmt: skip


def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    """ApiError -> its JSON answer; anything unexpected -> a logged 500 in the same shape."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except Exception as exc:
            logger.exception("internal error on %s", request.url.path)
            return error_response(ApiError(500, f"internal error: {exc!r}", None,
                                           "internal_error"))  # fmt: skip

    return guarded


def _with_api_key(app: Starlette, api_key: str) -> Any:
    """Wrap `app` so that requests outside OPEN_PATHS need the Bearer key (else 401)."""
    expected = f"Bearer {api_key}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                error = ApiError(401, "missing or wrong API key: send Authorization: Bearer "
                                 "<key>", None, "authentication_error", "invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await app(scope, receive, send)

    guarded.app = app  # type: ignore[attr-defined]
    return guarded
