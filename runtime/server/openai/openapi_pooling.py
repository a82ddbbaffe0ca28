"""The pooling routes' part of the OpenAPI document: a pooling model's paths and answers."""

from __future__ import annotations

from typing import Any

from loomllm.protocols.messages import Pooling
from loomllm.server.bodies.openapi_schemas import Schema
from loomllm.server.openai.openapi_parts import EXAMPLE_TEXT, json_, object_of, operation, ref


def pooling_responses(model: Schema) -> dict[str, Schema]:
    """The pooling routes' answers."""
    count = {"type": "integer", "minimum": 0}
    numbers = {"type": "array", "items": {"type": "number"}}
    usage = object_of(
        {"prompt_tokens": count, "total_tokens": count}, ["prompt_tokens", "total_tokens"]
    )

    def listed(item: Schema, with_id: bool) -> Schema:
        props = {
            **({"id": {"type": "string"}, "created": {"type": "integer"}} if with_id else {}),
            "object": {"const": "list"},
            "model": model,
            "data": {"type": "array", "items": item},
            "usage": ref("PoolingUsage"),
        }
        return object_of(props, list(props))

    embedding: Schema = {
        "object": {"const": "embedding"},
        "index": count,
        "embedding": {"anyOf": [numbers, {"type": "string", "description": "base64"}]},
    }
    score: Schema = {"index": count, "object": {"const": "score"}, "score": {"type": "number"}}
    label: Schema = {
        "index": count,
        "label": {"type": "string"},
        "probs": numbers,
        "num_classes": count,
    }
    result = object_of(
        {
            "index": count,
            "relevance_score": {"type": "number"},
            "document": object_of({"text": {"type": "string"}}, ["text"]),
        },
        ["index", "relevance_score"],
    )
    rerank = {
        "id": {"type": "string"},
        "model": model,
        "usage": ref("PoolingUsage"),
        "results": {"type": "array", "items": result},
    }
    return {
        "PoolingUsage": usage,
        "Embeddings": listed(object_of(embedding, list(embedding)), False),
        "Scores": listed(object_of(score, list(score)), True),
        "Classifications": listed(object_of(label, list(label)), True),
        "Rerank": object_of(rerank, list(rerank)),
    }


def pooling_paths(pooling: Pooling, errors: list[str]) -> dict[str, Schema]:
    """A pooling model's routes: a classifier's classify, an embedder's embeddings; both
    score and rerank."""
    text = EXAMPLE_TEXT

    def post(summary: str, request: str, answer: str, example: Any) -> Schema:
        return {"post": operation(summary, request, json_(ref(answer)), errors, example)}

    score = post("pair scores", "ScoreBody", "Scores", {"text_1": text, "text_2": [text]})
    rerank = post(
        "documents by relevance", "RerankBody", "Rerank", {"query": text, "documents": [text]}
    )
    paths = {"/v1/score": score, "/score": score, "/v1/rerank": rerank, "/rerank": rerank}
    if pooling.method == "classify":
        paths["/classify"] = post(
            "class probabilities", "ClassifyBody", "Classifications", {"input": text}
        )
    else:
        paths["/v1/embeddings"] = post("embeddings", "EmbeddingBody", "Embeddings", {"input": text})
    return paths
