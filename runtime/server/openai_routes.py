"""The OpenAI-compatible routes (and vLLM's tokenize, score, rerank, classify), as plain
handlers over the server's models in `app.state.server`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loomllm.engine.engine import Engine
from loomllm.server.bodies.openai_bodies import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    raw_messages,
)
from loomllm.server.bodies.pooling_bodies import (
    ClassifyBody,
    EmbeddingBody,
    PoolingBody,
    RerankBody,
    ScoreBody,
)
from loomllm.server.disconnect import unless_disconnected
from loomllm.server.openai import serving
from loomllm.server.openai.body_parsing import parse
from loomllm.server.openai.chat_template_fields import TEMPLATE_ERRORS, parse_template_fields
from loomllm.server.openai.classify import create_classification
from loomllm.server.openai.embeddings import create_embeddings
from loomllm.server.openai.schemas import bad, from_value_error, parse_chat, parse_completion
from loomllm.server.openai.scores import create_rerank, create_scores
from loomllm.server.openai.sse import EventStreamResponse
from loomllm.server.request_body import read_body
from loomllm.server.state import server_state

Handler = Callable[[Request], Awaitable[Response]]
Body = TypeVar("Body", bound=PoolingBody)


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
    body = parse(CompletionBody, await read_body(request))
    async with server_state(request).fleet.use(body.model) as served:
        req = parse_completion(body, served.engine.sampling_defaults)
        req.common.lora = served.lora
        return await answer(served.engine, request, req, served.name)


async def chat(request: Request) -> Response:
    body = parse(ChatBody, await read_body(request))
    state = server_state(request)
    async with state.fleet.use(body.model) as served:
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


def pooled(model: type[Body], create: Callable[[Engine, Body, str], Awaitable[Any]]) -> Handler:
    """A pooling route: the body read as `model` and answered by `create`."""

    async def route(request: Request) -> Response:
        body = parse(model, await read_body(request))
        async with server_state(request).fleet.use(body.model) as served:
            answer = await unless_disconnected(
                request, lambda: create(served.engine, body, served.name)
            )
        if answer is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(answer)

    return route


async def tokenize(request: Request) -> Response:
    body = parse(TokenizeBody, await read_body(request))
    state = server_state(request)
    async with state.fleet.use(body.model) as served:
        tokenizer, max_model_len = served.engine.tokenizer, served.engine.max_model_len
    assert tokenizer is not None
    template = parse_template_fields(
        body, tokenizer.chat_templates, state.trust_request_chat_template
    )
    if body.messages is not None:
        try:
            text = tokenizer.apply_chat_template(
                raw_messages(body.messages), **template.render_kwargs()
            )
        except ValueError as exc:
            raise from_value_error(exc, "messages", TEMPLATE_ERRORS) from None
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        assert body.prompt is not None  # TokenizeBody asks for one of the two
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})


async def detokenize(request: Request) -> Response:
    body = parse(DetokenizeBody, await read_body(request))
    async with server_state(request).fleet.use(body.model) as served:
        engine = served.engine
    vocab = engine.model_info.vocab_size
    if not all(t < vocab for t in body.tokens):
        raise bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    assert engine.tokenizer is not None
    return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})


# (path, handler, method): the app wraps each handler in its error guard.
ROUTES: list[tuple[str, Handler, str]] = [
    ("/v1/models", models, "GET"),
    ("/v1/completions", completions, "POST"),
    ("/v1/chat/completions", chat, "POST"),
    ("/v1/embeddings", pooled(EmbeddingBody, create_embeddings), "POST"),
    ("/v1/score", pooled(ScoreBody, create_scores), "POST"),
    ("/v1/rerank", pooled(RerankBody, create_rerank), "POST"),
    ("/rerank", pooled(RerankBody, create_rerank), "POST"),
    ("/score", pooled(ScoreBody, create_scores), "POST"),
    ("/classify", pooled(ClassifyBody, create_classification), "POST"),
    ("/tokenize", tokenize, "POST"),
    ("/detokenize", detokenize, "POST"),
]
