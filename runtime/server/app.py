"""The OpenAI-compatible HTTP API (and Ollama's) as a Starlette app over a server's models.

The handlers live in openai_routes.py, ollama_routes.py and service_routes.py, and
read the models and settings from `app.state.server` (state.py).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loomllm.engine.engine import Engine
from loomllm.server import openai_routes, service_routes
from loomllm.server.fleet.fleet import ModelFleet
from loomllm.server.fleet.supervisor import EngineSlot
from loomllm.server.lora_adapters import load_lora_adapter, unload_lora_adapter
from loomllm.server.metrics import build_metrics_handler
from loomllm.server.ollama_routes import OLLAMA_ROUTES
from loomllm.server.openai.openapi import build_openapi
from loomllm.server.openai.schemas import ApiError
from loomllm.server.parsers.reasoning import PARSERS as REASONING_PARSERS
from loomllm.server.parsers.tool_parsers import PARSERS as TOOL_PARSERS
from loomllm.server.request_body import MAX_BODY_BYTES, drain_body
from loomllm.server.state import ServerState

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")  # as vLLM: no API key


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(
    source: Engine | EngineSlot | ModelFleet,
    served_model_name: str | None = None,
    *,
    api_key: str | None = None,
    health_timeout: float = 10.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allow_runtime_lora_updating: bool = False,
) -> Starlette:
    """An ASGI app serving the models of `source`.

    `source` is a ModelFleet (a request's `model` picks one, loaded on demand), or one engine
    served as `served_model_name`: an Engine, or an EngineSlot whose engine is replaced while
    the app runs (restarts). Each request uses the engine of its model at its start, and gets
    503 while there is none. With `api_key`, every route outside OPEN_PATHS needs
    `Authorization: Bearer <key>`. Bodies over `max_body_bytes` get 413. A body's
    `chat_template` may name one of the model's templates; its own template text only with
    `trust_request_chat_template`. `tool_call_parser` (one of tool_parsers.PARSERS):
    tool_choice "auto" reads calls out of the answers; None: "auto" is a 400.
    `reasoning_parser` (one of reasoning.PARSERS): chat answers' reasoning is split out into
    the message's `reasoning`. `allow_runtime_lora_updating`: vLLM's /v1/load_lora_adapter
    and /v1/unload_lora_adapter.
    """
    if tool_call_parser not in (None, *TOOL_PARSERS):
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}"
        )
    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
            f"got {reasoning_parser!r}"
        )
    if isinstance(source, ModelFleet):
        fleet = source
    else:
        slot = source if isinstance(source, EngineSlot) else EngineSlot(source)
        fleet = ModelFleet.of(slot, served_model_name or slot.require().config.model)
    first = next(served for served in fleet.running() if served.name == fleet.default).engine
    assert first.tokenizer is not None
    schema = build_openapi(
        fleet.default,
        first.max_model_len,
        first.model_info.vocab_size,
        needs_api_key=api_key is not None,
        open_paths=OPEN_PATHS,
        template_names=first.tokenizer.chat_templates,
        trust_request_chat_template=trust_request_chat_template,
        reasoning=reasoning_parser is not None,
        priority=first.config.scheduling_policy == "priority",
        one_model=len(fleet.models) == 1,
        pooling=first.model_info.pooling,
    )
    routes = [*openai_routes.ROUTES]
    routes += [
        ("/health", service_routes.health, "GET"),
        ("/version", service_routes.version, "GET"),
        ("/metrics", build_metrics_handler(fleet), "GET"),
        ("/openapi.json", service_routes.openapi, "GET"),
    ]
    if allow_runtime_lora_updating:
        routes += [
            ("/v1/load_lora_adapter", load_lora_adapter, "POST"),
            ("/v1/unload_lora_adapter", unload_lora_adapter, "POST"),
        ]
    guarded = [Route(path, _guard(handler), methods=[method]) for path, handler, method in routes]
    app = Starlette(routes=guarded + OLLAMA_ROUTES, exception_handlers={HTTPException: _http_error})
    app.state.server = ServerState(
        fleet=fleet,
        max_body_bytes=max_body_bytes,
        health_timeout=health_timeout,
        trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        created=int(time.time()),
        openapi=schema,
    )
    if api_key is not None:
        return _with_api_key(app, api_key)  # type: ignore[return-value]
    return app


def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    response = error_response(
        ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, kind)
    )
    response.headers.update(exc.headers or {})  # 405's Allow (RFC 9110)
    return response


def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    """ApiError -> its JSON answer; anything unexpected -> a logged 500 in the same shape.

    Every error a client can cause is a 4xx in OpenAI's error shape; engine failures are 5xx.
    """

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:  # gone while sending its body: nobody reads an answer
            logger.debug("client left during its request body on %s", request.url.path)
            return Response(status_code=499)
        except Exception as exc:
            logger.exception("internal error on %s", request.url.path)
            return error_response(ApiError(500, f"internal error: {exc!r}", None, "internal_error"))

    return guarded


def _with_api_key(app: Starlette, api_key: str) -> Any:
    """Wrap `app` so that requests outside OPEN_PATHS need the Bearer key (else 401)."""
    expected = f"Bearer {api_key}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                error = ApiError(
                    401,
                    "missing or wrong API key: send Authorization: Bearer <key>",
                    None,
                    "authentication_error",
                    "invalid_api_key",
                )
                await drain_body(receive, MAX_BODY_BYTES)
                await error_response(error)(scope, receive, send)
                return
        await app(scope, receive, send)

    guarded.app = app  # type: ignore[attr-defined]
    return guarded
