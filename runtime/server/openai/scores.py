"""/v1/score (vLLM's) and /v1/rerank (Jina's and Cohere's shapes) on a pooling engine: a
bi-encoder scores a pair by the cosine similarity of its two embeddings (Engine.score)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from loomllm.engine.engine import Engine
from loomllm.errors import EngineClosedError, EngineDeadError
from loomllm.server.bodies.pooling_bodies import RerankBody, ScoreBody, as_list
from loomllm.server.openai.schemas import from_value_error
from loomllm.server.openai.serving import engine_error


async def scored(engine: Engine, first: list[str], second: list[str], param: str) -> list[Any]:
    """Engine.score's outputs; its errors as the API's (a ValueError a 400 naming `param`)."""
    try:
        return await engine.score(first, second)
    except ValueError as exc:
        raise from_value_error(exc, param, {"model": "model"}) from None
    except (EngineDeadError, EngineClosedError) as exc:
        raise engine_error(exc) from None


async def create_scores(engine: Engine, body: ScoreBody, model: str) -> dict[str, Any]:
    first, second = as_list(body.text_1), as_list(body.text_2)  # ScoreBody checked the pairing
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


async def create_rerank(engine: Engine, body: RerankBody, model: str) -> dict[str, Any]:
    documents = body.documents
    top_n = len(documents) if body.top_n is None else body.top_n
    with_documents = body.return_documents is not False
    outputs = await scored(engine, [body.query], documents, "documents")
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
