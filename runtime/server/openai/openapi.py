"""The server's OpenAPI 3.1 document, built from its real limits; served at GET /openapi.json.

The request bodies' schemas come from their models (bodies/openapi_schemas.py); the answers'
are here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from loomllm.protocols.messages import Pooling
from loomllm.server.bodies.openapi_schemas import (
    GENERATION_BODIES,
    POOLING_BODIES,
    Schema,
    request_schemas,
)
from loomllm.server.openai.openapi_parts import EXAMPLE_TEXT, json_, object_of, operation, ref
from loomllm.server.openai.openapi_pooling import pooling_paths, pooling_responses

# "abort": the server shut down mid-request; "tool_calls": tool_choice "required"
FINISH_REASONS = ["stop", "length", "abort", "tool_calls"]


def _responses(model: Schema, reasoning: bool) -> dict[str, Schema]:
    """The answers' schemas; with `reasoning`, chat messages and deltas carry it (vLLM's
    `reasoning`, and `reasoning_content`, its earlier name)."""

    def envelope(kind: str, choice: Schema, chunk: bool) -> Schema:
        props: dict[str, Schema] = {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": model,
            "choices": {"type": "array", "items": choice},
            "usage": ref("Usage"),
        }
        # A chunk has usage only when it is the last one, with stream_options.include_usage.
        return object_of(props, [name for name in props if not (chunk and name == "usage")])

    count = {"type": "integer", "minimum": 0}
    finish = {"enum": FINISH_REASONS}
    maybe_finish = {"enum": [*FINISH_REASONS, None]}
    text_logprobs = {
        "anyOf": [
            {"type": "null"},
            object_of(
                {
                    "tokens": {"type": "array", "items": {"type": "string"}},
                    # null for an echoed prompt's first token (nothing predicts it)
                    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                    "top_logprobs": {
                        "type": "array",
                        "items": {
                            "type": ["object", "null"],
                            "additionalProperties": {"type": "number"},
                        },
                    },
                    "text_offset": {"type": "array", "items": count},
                },
                ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            ),
        ]
    }
    top: dict[str, Schema] = {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    }
    tops = {"type": "array", "items": object_of(top, list(top))}
    entry = object_of({**top, "top_logprobs": tops}, [*top, "top_logprobs"])
    chat_logprobs = {
        "anyOf": [
            {"type": "null"},
            object_of({"content": {"type": "array", "items": entry}}, ["content"]),
        ]
    }

    def choice(body: dict[str, Schema], logprobs: Schema, reason: Schema) -> Schema:
        props = {"index": count, **body, "logprobs": logprobs, "finish_reason": reason}
        return object_of(props, list(props))

    text = {"text": {"type": "string"}}
    call = object_of(
        {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": object_of(
                {"name": {"type": "string"}, "arguments": {"type": "string"}}, ["name", "arguments"]
            ),
        },
        ["id", "type", "function"],
    )
    thought = {"type": ["string", "null"]}
    thoughts = {"reasoning": thought, "reasoning_content": thought} if reasoning else {}
    message = {
        "message": object_of(
            {
                "role": {"const": "assistant"},
                "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": call},
                **thoughts,
            },
            ["role", "content"],
        )
    }
    call_delta = object_of(
        {
            "index": count,
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": object_of({"name": {"type": "string"}, "arguments": {"type": "string"}}),
        },
        ["index"],
    )
    delta = {
        "delta": object_of(
            {
                "role": {"const": "assistant"},
                "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": call_delta},
                **thoughts,
            }
        )
    }
    return {
        "Usage": object_of(
            {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count},
            ["prompt_tokens", "completion_tokens", "total_tokens"],
        ),
        "Completion": envelope("text_completion", choice(text, text_logprobs, finish), False),
        "CompletionChunk": envelope(
            "text_completion", choice(text, text_logprobs, maybe_finish), True
        ),
        "ChatCompletion": envelope(
            "chat.completion", choice(message, chat_logprobs, finish), False
        ),
        "ChatCompletionChunk": envelope(
            "chat.completion.chunk", choice(delta, chat_logprobs, maybe_finish), True
        ),
        "Error": object_of(
            {
                "error": object_of(
                    {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "integer", "null"]},
                    },
                    ["message", "type", "param", "code"],
                )
            },
            ["error"],
        ),
    }


def _event_stream(chunk: str) -> Schema:
    """SSE: each event's data is a chunk (or an error, then the stream ends) or [DONE]."""
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [ref(chunk), ref("Error")]},
            },
        ]
    }
    return {"schema": object_of({"data": data}, ["data"])}


def build_openapi(
    model: str,
    max_model_len: int,
    vocab_size: int,
    *,
    needs_api_key: bool = False,
    open_paths: Collection[str] = (),
    template_names: Collection[str] = (),
    trust_request_chat_template: bool = False,
    reasoning: bool = False,
    priority: bool = False,
    one_model: bool = True,
    pooling: Pooling | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of build_app()'s routes, for this model and these limits.

    With `needs_api_key`, the routes outside `open_paths` require a Bearer token (else 401).
    `template_names`: the model's chat templates, which a body's chat_template may name.
    With several models (not `one_model`), `model` is the default one: answers may name any,
    and /v1/models lists unloaded ones without a max_model_len. A pooling model (`pooling`)
    has the pooling routes its kind answers instead of completions and chat.
    """
    body_errors = ["400", "404", "413", "415", "500", "503"] + (["401"] if needs_api_key else [])
    get_errors = ["401"] if needs_api_key else []  # /v1/models; /health and /version: open

    answer_model: Schema = {"const": model} if one_model else {"type": "string"}
    card = object_of(
        {
            "id": answer_model,
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "root": {"type": "string"},
            "loaded": {"const": True} if one_model else {"type": "boolean"},
            "max_model_len": {"const": max_model_len} if one_model else {"type": "integer"},
        },
        ["id", "object", "created", "owned_by", "root", "loaded"]
        + (["max_model_len"] if one_model else []),
    )
    models = object_of(
        {"object": {"const": "list"}, "data": {"type": "array", "items": card}}, ["object", "data"]
    )
    text = EXAMPLE_TEXT
    # OpenAI's example asks 7 tokens; a short context leaves room for fewer beside the prompt.
    example_max_tokens = min(7, max(1, max_model_len // 4))
    examples = {
        "completion": {
            "model": model,
            "prompt": text,
            "max_tokens": example_max_tokens,
            "temperature": 0,
        },
        "chat": {"model": model, "messages": [{"role": "user", "content": text}]},
    }
    status = object_of(
        {"status": {"enum": ["ok", "unhealthy"]}, "error": {"type": "string"}}, ["status"]
    )
    paths = {
        "/v1/models": {"get": operation("the served model", None, json_(models), get_errors)},
        "/v1/completions": {
            "post": operation(
                "text completion",
                "CompletionBody",
                json_(ref("Completion")) | {"text/event-stream": _event_stream("CompletionChunk")},
                body_errors,
                examples["completion"],
            )
        },
        "/v1/chat/completions": {
            "post": operation(
                "chat completion",
                "ChatBody",
                json_(ref("ChatCompletion"))
                | {"text/event-stream": _event_stream("ChatCompletionChunk")},
                body_errors,
                examples["chat"],
            )
        },
        "/tokenize": {
            "post": operation(
                "text or messages to token ids",
                "TokenizeBody",
                json_(
                    object_of(
                        {
                            "count": {"type": "integer"},
                            "max_model_len": {"const": max_model_len},
                            "tokens": {"type": "array", "items": {"type": "integer"}},
                        },
                        ["count", "max_model_len", "tokens"],
                    )
                ),
                body_errors,
                {"model": model, "prompt": text},
            )
        },
        "/detokenize": {
            "post": operation(
                "token ids to text",
                "DetokenizeBody",
                json_(object_of({"prompt": {"type": "string"}}, ["prompt"])),
                body_errors,
                {"model": model, "tokens": [0]},
            )
        },
        "/health": {"get": operation("one 1-token generation", None, json_(status), [])},
        "/version": {
            "get": operation(
                "the loomllm version",
                None,
                json_(object_of({"version": {"type": "string"}}, ["version"])),
                [],
            )
        },
    }
    if pooling is not None:
        for path in ("/v1/completions", "/v1/chat/completions"):
            del paths[path]
        paths |= pooling_paths(pooling, body_errors)
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "unhealthy",
        "content": json_(status),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "loomllm OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": request_schemas(
                GENERATION_BODIES if pooling is None else GENERATION_BODIES[2:] + POOLING_BODIES,
                model,
                max_model_len,
                vocab_size,
                template_names,
                trust_request_chat_template,
                priority,
                pooling,
            )
            | _responses(answer_model, reasoning)
            | pooling_responses(answer_model)
        },
    }
    if needs_api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path not in open_paths:
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
