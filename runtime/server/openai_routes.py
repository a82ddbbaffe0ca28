"""The OpenAI-compatible routes (and vLLM's tokenize, score, rerank, classify), as plain
handlers over the server's models in `app.state.server`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loomllm.engine.engine import Engine
from loomllm.server.disconnect import unless_disconnected
from loomllm.server.openai import serving
from loomllm.server.openai.chat_template_fields import TEMPLATE_ERRORS, parse_template_fields
from loomllm.server.openai.classify import create_classification
from loomllm.server.openai.embeddings import answer_embeddings
from loomllm.server.openai.schemas import (
    bad,
    field,
    from_value_error,
    parse_chat,
    parse_completion,
)
from loomllm.server.openai.scores import create_rerank, create_scores
from loomllm.server.openai.sse import EventStreamResponse
from loomllm.server.request_body import read_body
from loomllm.server.state import server_state

Handler = Callable[[Request], Awaitable[Response]]


def model_of(body: dict[str, Any]) -> str | None:
    return field(body, "model", "str")


async def answer(engine: Engine, request: Request, req: Any, model: str) -> Response:
    """A completion or chat answer: one JSON object, or an event stream."""
    if req.common.stream:
        produce = await unless_disconnected(request, lambda: serving.stream(engine, req, model))
        if produce is None:  # the client left before the first byte
            return Response(status_code=499)
        return EventStreamResponse(produce)  # type: ignore[return-value]
    body = await unless_disconnected(request, lambda: serving.complete(engine, req, model))
    if body is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(body)


async def models(request: Request) -> Response:
    state = server_state(request)
    fleet = state.fleet
    running = {served.name: served.engine for served in fleet.running()}
    cards = []
    for entry in await fleet.available():
        card: dict[str, Any] = {
            "id": entry.name,
            "object": "model",
            "created": state.created,
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
                "created": state.created,
                "owned_by": "loomllm",
                "root": lora.lora_path,
                "parent": base,
                "loaded": base in running,
            }
        )
    return JSONResponse({"object": "list", "data": cards})


async def completions(request: Request) -> Response:
    body = await read_body(request)
    async with server_state(request).fleet.use(model_of(body)) as served:
        req = parse_completion(body, served.engine.sampling_defaults)
        req.common.lora = served.lora
        return await answer(served.engine, request, req, served.name)


async def chat(request: Request) -> Response:
    body = await read_body(request)
    state = server_state(request)
    async with state.fleet.use(model_of(body)) as served:
        assert served.engine.tokenizer is not None
        req = parse_chat(
            body,
            served.engine.tokenizer.chat_templates,
            state.trust_request_chat_template,
            auto_tools=state.tool_call_parser is not None,
            reasoning_parser=state.reasoning_parser,
            defaults=served.engine.sampling_defaults,
        )
        req.common.lora = served.lora
        return await answer(served.engine, request, req, served.name)


def pooled(create: Callable[[Engine, dict[str, Any], str], Awaitable[Any]]) -> Handler:
    """A pooling route: the body checked and answered by `create`."""

    async def route(request: Request) -> Response:
        body = await read_body(request)
        async with server_state(request).fleet.use(model_of(body)) as served:
            answer = await unless_disconnected(
                request, lambda: create(served.engine, body, served.name)
            )
        if answer is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(answer)

    return route


async def tokenize(request: Request) -> Response:
    body = await read_body(request)
    state = server_state(request)
    async with state.fleet.use(model_of(body)) as served:
        tokenizer, max_model_len = served.engine.tokenizer, served.engine.max_model_len
    assert tokenizer is not None
    add_special = field(body, "add_special_tokens", "bool", True)
    text = field(body, "prompt", "str")  # checked even when messages win
    # Checked even when a prompt is tokenized: the schema states them for every body.
    template = parse_template_fields(
        body, tokenizer.chat_templates, state.trust_request_chat_template
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
    async with server_state(request).fleet.use(model) as served:
        engine = served.engine
    vocab = engine.model_info.vocab_size
    if tokens is None or not all(0 <= t < vocab for t in tokens):
        raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    assert engine.tokenizer is not None
    return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})


# (path, handler, method): the app wraps each handler in its error guard.
ROUTES: list[tuple[str, Handler, str]] = [
    ("/v1/models", models, "GET"),
    ("/v1/completions", completions, "POST"),
    ("/v1/chat/completions", chat, "POST"),
    ("/v1/embeddings", pooled(answer_embeddings), "POST"),
    ("/v1/score", pooled(create_scores), "POST"),
    ("/v1/rerank", pooled(create_rerank), "POST"),
    ("/rerank", pooled(create_rerank), "POST"),
    ("/score", pooled(create_scores), "POST"),
    ("/classify", pooled(create_classification), "POST"),
    ("/tokenize", tokenize, "POST"),
    ("/detokenize", detokenize, "POST"),
]
