"""/v1/embeddings: OpenAI's request and response shapes over a pooling engine's embeddings
(Engine.embed_stream), every input batched in the engine at once."""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from loomllm.engine.engine import Engine
from loomllm.engine.request_stream import RequestStream, start_all
from loomllm.errors import EngineClosedError, EngineDeadError
from loomllm.server.bodies.pooling_bodies import ClassifyBody, EmbeddingBody
from loomllm.server.openai.schemas import from_value_error
from loomllm.server.openai.serving import engine_error, final_outputs


def prompts_of(body: ClassifyBody) -> list[str | dict[str, Any]]:
    """The body's `input`, as the engine's prompts: each a text or {"prompt_token_ids": [...]}."""
    raw = body.input
    items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
    return [item if isinstance(item, str) else {"prompt_token_ids": item} for item in items]  # type: ignore[misc]


async def create_embeddings(engine: Engine, req: EmbeddingBody, model: str) -> dict[str, Any]:
    """Every input's embedding, in input order, with the prompt tokens used."""
    base_id = f"embd-{uuid.uuid4().hex}"
    prompts = prompts_of(req)
    starts = (
        partial(
            engine.embed_stream,
            prompt,
            dimensions=req.dimensions,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=f"{base_id}-{i}",
        )
        for i, prompt in enumerate(prompts)
    )
    finals = await final_outputs(started(starts))
    data, prompt_tokens = [], 0
    for i in range(len(prompts)):
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


def _encoded(vector: list[float], req: EmbeddingBody) -> list[float] | str:
    if req.encoding_format in (None, "float"):
        return vector
    # OpenAI's base64: the float32 values, little-endian, as its clients decode them.
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
