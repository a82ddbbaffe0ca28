"""/v1/score (vLLM's) and /v1/rerank (Jina's and Cohere's shapes) on a pooling engine: a
bi-encoder scores a pair by the cosine similarity of its two embeddings (Engine.score)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from loomllm.engine.engine import Engine
from loomllm.errors import EngineClosedError, EngineDeadError
from loomllm.server.openai.api_error import bad
from loomllm.server.openai.embeddings import MAX_INPUTS
from loomllm.server.openai.schemas import field, from_value_error
from loomllm.server.openai.serving import engine_error


def texts(body: dict[str, Any], name: str, one_allowed: bool = True) -> list[str]:
    """body[name]: a non-empty string (where `one_allowed`) or list of them, checked."""
    value = body.get(name)
    if one_allowed and isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or len(value) > MAX_INPUTS:
        what = "a string or a list of strings" if one_allowed else "a list of strings"
        raise bad(f"{name} must be {what}, 1 to {MAX_INPUTS} of them", name)
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text:
            raise bad(f"{name}[{i}] must be a non-empty string, got {text!r:.40}", name)
    return value


async def scored(engine: Engine, first: list[str], second: list[str], param: str) -> list[Any]:
    """Engine.score's outputs; its errors as the API's (a ValueError a 400 naming `param`)."""
    try:
        return await engine.score(first, second)
    except ValueError as exc:
        raise from_value_error(exc, param, {"model": "model"}) from None
    except (EngineDeadError, EngineClosedError) as exc:
        raise engine_error(exc) from None


async def create_scores(engine: Engine, body: dict[str, Any], model: str) -> dict[str, Any]:
    first, second = texts(body, "text_1"), texts(body, "text_2")
    if len(first) not in (1, len(second)):
        raise bad(
            f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2",
            "text_1",
        )
    outputs = await scored(engine, first, second, "text_1")
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "score", "score": out.outputs.score}
            for i, out in enumerate(outputs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def create_rerank(engine: Engine, body: dict[str, Any], model: str) -> dict[str, Any]:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad("query must be a non-empty string", "query")
    documents = texts(body, "documents", one_allowed=False)
    top_n = field(body, "top_n", "int", len(documents))
    if top_n < 1:
        raise bad(f"top_n must be at least 1, got {top_n}", "top_n")
    with_documents = field(body, "return_documents", "bool", True)
    outputs = await scored(engine, [query], documents, "documents")
    ranked = sorted(range(len(documents)), key=lambda i: -outputs[i].outputs.score)[:top_n]
    results = []
    for i in ranked:
        result: dict[str, Any] = {"index": i, "relevance_score": outputs[i].outputs.score}
        if with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
