"""The OpenAI-compatible HTTP API (and Ollama's) as a Starlette app over a server's models.

Bodies are read by request_body.py; routes parse with schemas.py, run with serving.py and
stream with sse.py.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loomllm.engine.engine import Engine
from loomllm.protocols.sampling import SamplingParams
from loomllm.server.fleet.fleet import ModelFleet
from loomllm.server.fleet.supervisor import EngineSlot
from loomllm.server.lora_adapters import load_adapter, unload_adapter
from loomllm.server.metrics import build_metrics_handler
from loomllm.server.ollama.routes import ollama_routes
from loomllm.server.openai import serving
from loomllm.server.openai.chat_template_fields import TEMPLATE_ERRORS, parse_template_fields
from loomllm.server.openai.classify import create_classification
from loomllm.server.openai.embeddings import answer_embeddings
from loomllm.server.openai.openapi import build_openapi
from loomllm.server.openai.schemas import (
    ApiError,
    bad,
    field,
    from_value_error,
    parse_chat,
    parse_completion,
)
from loomllm.server.openai.scores import create_rerank, create_scores
from loomllm.server.openai.sse import EventStreamResponse
from loomllm.server.parsers.reasoning import PARSERS as REASONING_PARSERS
from loomllm.server.parsers.tool_parsers import PARSERS as TOOL_PARSERS
from loomllm.server.request_body import MAX_BODY_BYTES, drain_body, read_json

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")  # as vLLM: no API key


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


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
        except Exception as exc:  # re-raised below, outside the group, so never wrapped
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def answer(engine: Engine, request: Request, req: Any, model: str) -> Response:
    if req.common.stream:
        produce = await unless_disconnected(request, lambda: serving.stream(engine, req, model))
        if produce is None:  # the client left before the first byte
            return Response(status_code=499)
        return EventStreamResponse(produce)  # type: ignore[return-value]
    body = await unless_disconnected(request, lambda: serving.complete(engine, req, model))
    if body is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


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
    created = int(time.time())

    async def read_body(request: Request) -> dict[str, Any]:
        return await read_json(request, max_body_bytes)

    def model_of(body: dict[str, Any]) -> str | None:
        return field(body, "model", "str")

    async def models(request: Request) -> Response:
        running = {served.name: served.engine for served in fleet.running()}
        cards = []
        for entry in await fleet.available():
            card: dict[str, Any] = {
                "id": entry.name,
                "object": "model",
                "created": created,
                "owned_by": "loomllm",
                "root": entry.model,
                "loaded": entry.name in running,
            }
            if entry.name in running:
                card["max_model_len"] = running[entry.name].max_model_len
            cards.append(card)
        for name, (base, lora) in fleet.adapters.items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "loomllm",
                    "root": lora.lora_path,
                    "parent": base,
                    "loaded": base in running,
                }
            )
        return JSONResponse({"object": "list", "data": cards})

    async def completions(request: Request) -> Response:
        body = await read_body(request)
        async with fleet.use(model_of(body)) as served:
            req = parse_completion(body, served.engine.sampling_defaults)
            req.common.lora = served.lora
            return await answer(served.engine, request, req, served.name)

    async def chat(request: Request) -> Response:
        body = await read_body(request)
        async with fleet.use(model_of(body)) as served:
            assert served.engine.tokenizer is not None
            req = parse_chat(
                body,
                served.engine.tokenizer.chat_templates,
                trust_request_chat_template,
                auto_tools=tool_call_parser is not None,
                reasoning_parser=reasoning_parser,
                defaults=served.engine.sampling_defaults,
            )
            req.common.lora = served.lora
            return await answer(served.engine, request, req, served.name)

    def pooled(create: Callable[[Engine, dict[str, Any], str], Awaitable[Any]]) -> Any:
        """A pooling route: the body checked and answered by `create`."""

        async def route(request: Request) -> Response:
            body = await read_body(request)
            async with fleet.use(model_of(body)) as served:
                answer = await unless_disconnected(
                    request, lambda: create(served.engine, body, served.name)
                )
            if answer is None:  # the client left; nobody reads this
                return Response(status_code=499)
            return JSONResponse(answer)

        return route

    async def tokenize(request: Request) -> Response:
        body = await read_body(request)
        async with fleet.use(model_of(body)) as served:
            tokenizer, max_model_len = served.engine.tokenizer, served.engine.max_model_len
        assert tokenizer is not None
        add_special = field(body, "add_special_tokens", "bool", True)
        text = field(body, "prompt", "str")  # checked even when messages win
        # Checked even when a prompt is tokenized: the schema states them for every body.
        template = parse_template_fields(
            body, tokenizer.chat_templates, trust_request_chat_template
        )
        if body.get("messages") is not None:
            try:
                text = tokenizer.apply_chat_template(
                    field(body, "messages", "list"), **template.render_kwargs()
                )
            except ValueError as exc:
                raise from_value_error(exc, "messages", TEMPLATE_ERRORS) from None
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            if text is None:
                raise bad("prompt (a string) or messages is required", "prompt")
            ids = tokenizer.encode(text, add_special_tokens=add_special)
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await read_body(request)
        model = model_of(body)
        tokens = field(body, "tokens", "int_list")
        async with fleet.use(model) as served:
            engine = served.engine
        vocab = engine.model_info.vocab_size
        if tokens is None or not all(0 <= t < vocab for t in tokens):
            raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        assert engine.tokenizer is not None
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    async def health(request: Request) -> Response:
        running = fleet.running()
        if fleet.draining or not running:
            why = "the server is shutting down" if fleet.draining else "no model is running"
            return JSONResponse({"status": "unhealthy", "error": why}, status_code=503)
        try:
            with anyio.fail_after(health_timeout):
                for served in running:
                    await _probe(served.engine)
        except Exception as exc:
            logger.warning("health check failed: %r", exc)
            return JSONResponse({"status": "unhealthy", "error": repr(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    assert first.tokenizer is not None
    schema = build_openapi(
        fleet.default,
        first.max_model_len,
        first.model_info.vocab_size,
        needs_api_key=api_key is not None,
        open_paths=OPEN_PATHS,
        template_names=first.tokenizer.chat_templates,
        trust_request_chat_template=trust_request_chat_template,
        auto_tools=tool_call_parser is not None,
        reasoning=reasoning_parser is not None,
        priority=first.config.scheduling_policy == "priority",
        one_model=len(fleet.models) == 1,
    )

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

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
        Route("/v1/embeddings", _guard(pooled(answer_embeddings)), methods=["POST"]),
        Route("/v1/score", _guard(pooled(create_scores)), methods=["POST"]),
        Route("/v1/rerank", _guard(pooled(create_rerank)), methods=["POST"]),
        Route("/rerank", _guard(pooled(create_rerank)), methods=["POST"]),
        Route("/score", _guard(pooled(create_scores)), methods=["POST"]),
        Route("/classify", _guard(pooled(create_classification)), methods=["POST"]),
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
        Route("/health", _guard(health), methods=["GET"]),
        Route("/version", _guard(version), methods=["GET"]),
        Route("/metrics", _guard(build_metrics_handler(fleet)), methods=["GET"]),
        Route("/openapi.json", _guard(openapi), methods=["GET"]),
    ]
    if allow_runtime_lora_updating:

        async def load_lora(request: Request) -> Response:
            return load_adapter(fleet, await read_body(request))

        async def unload_lora(request: Request) -> Response:
            return unload_adapter(fleet, await read_body(request))

        routes += [
            Route("/v1/load_lora_adapter", _guard(load_lora), methods=["POST"]),
            Route("/v1/unload_lora_adapter", _guard(unload_lora), methods=["POST"]),
        ]
    routes += ollama_routes(fleet, read_body, unless_disconnected)
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    if api_key is not None:
        return _with_api_key(app, api_key)  # type: ignore[return-value]
    return app


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
