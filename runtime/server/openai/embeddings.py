"""/v1/embeddings: OpenAI's request and response shapes over a pooling engine's embeddings
(Engine.embed_stream), every input batched in the engine at once."""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from loomllm.engine.engine import Engine
from loomllm.engine.request_stream import RequestStream, start_all
from loomllm.errors import EngineClosedError, EngineDeadError
from loomllm.server.openai.api_error import bad
from loomllm.server.openai.schemas import as_int, field, from_value_error
from loomllm.server.openai.serving import engine_error, final_outputs

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    inputs: list[str | dict[str, Any]]  # text, or {"prompt_token_ids": [...]}
    encoding_format: str
    dimensions: int | None
    truncate_prompt_tokens: int | None


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """The body's fields, checked: a 400 naming the field that is wrong."""
    inputs = parse_inputs(body)
    encoding = field(body, "encoding_format", "str", "float")
    if encoding not in ENCODING_FORMATS:
        raise bad(f"encoding_format must be float or base64, got {encoding!r}", "encoding_format")
    return EmbeddingRequest(
        inputs,
        encoding,
        field(body, "dimensions", "int"),
        field(body, "truncate_prompt_tokens", "int"),
    )


def parse_inputs(body: dict[str, Any]) -> list[str | dict[str, Any]]:
    """The body's `input`: a string, token ids, or a list of either (at most MAX_INPUTS)."""
    raw = body.get("input")
    if isinstance(raw, str) or _is_ids(raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, and not empty",
            "input",
        )
    if len(raw) > MAX_INPUTS:
        raise bad(f"input holds {len(raw)} inputs; at most {MAX_INPUTS}", "input")
    inputs: list[str | dict[str, Any]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif _is_ids(item) and item:
            inputs.append({"prompt_token_ids": [as_int(t) for t in item]})
        else:
            raise bad(
                f"input[{i}] must be a non-empty string or list of token ids, got "
                f"{type(item).__name__} {str(item)[:40]!r}",
                "input",
            )
    return inputs


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(as_int(t)) is int for t in value)


async def answer_embeddings(engine: Engine, body: dict[str, Any], model: str) -> dict[str, Any]:
    """The route's answer to `body` (a 400 naming the field that is wrong)."""
    return await create_embeddings(engine, parse_embedding_request(body), model)


async def create_embeddings(engine: Engine, req: EmbeddingRequest, model: str) -> dict[str, Any]:
    """Every input's embedding, in input order, with the prompt tokens used."""
    base_id = f"embd-{uuid.uuid4().hex}"
    starts = (
        partial(
            engine.embed_stream,
            prompt,
            dimensions=req.dimensions,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=f"{base_id}-{i}",
        )
        for i, prompt in enumerate(req.inputs)
    )
    finals = await final_outputs(started(starts))
    data, prompt_tokens = [], 0
    for i in range(len(req.inputs)):
        vector = engine.embedding(finals[i], req.dimensions).outputs.embedding
        prompt_tokens += len(finals[i].prompt_token_ids)
        data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, req)})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def started(starts: Iterable[Callable[[], RequestStream]]) -> list[RequestStream]:
    """Each request started (start_all); a ValueError a 400 naming the field it is about."""
    try:
        return start_all(starts)
    except ValueError as exc:
        renames = {
            "prompt": "input",
            "prompt_token_ids": "input",
            "dimensions": "dimensions",
            "model": "model",
        }
        raise from_value_error(exc, "input", renames) from None
    except (EngineDeadError, EngineClosedError) as exc:
        raise engine_error(exc) from None


def _encoded(vector: list[float], req: EmbeddingRequest) -> list[float] | str:
    if req.encoding_format == "float":
        return vector
    # OpenAI's base64: the float32 values, little-endian, as its clients decode them.
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
