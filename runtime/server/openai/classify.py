"""/classify (vLLM's): a classifier's class probabilities for each input, with its labels."""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

from loomllm.engine.engine import Engine
from loomllm.server.bodies.pooling_bodies import ClassifyBody
from loomllm.server.openai.embeddings import prompts_of, started
from loomllm.server.openai.serving import final_outputs


async def create_classification(engine: Engine, body: ClassifyBody, model: str) -> dict[str, Any]:
    """Every input's probabilities, in input order (a 400 naming the field that is wrong)."""
    inputs = prompts_of(body)
    base_id = f"classify-{uuid.uuid4().hex}"
    streams = started(
        partial(engine.classify_stream, prompt, request_id=f"{base_id}-{i}")
        for i, prompt in enumerate(inputs)
    )
    finals = await final_outputs(streams)
    pooling = engine.model_info.pooling
    assert pooling is not None
    data, prompt_tokens = [], 0
    for i in range(len(inputs)):
        probs = engine.classification(finals[i]).outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        label = pooling.labels[best] if best < len(pooling.labels) else str(best)
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        prompt_tokens += len(finals[i].prompt_token_ids)
    return {
        "id": base_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
