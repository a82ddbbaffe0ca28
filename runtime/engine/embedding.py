"""Engine.embed's side of a pooling engine: the request it schedules, `dimensions` checked
and applied, and the final output turned into vLLM's EmbeddingRequestOutput; and
Engine.score's pairs, each scored by the cosine similarity of its two embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from loomllm.engine.request_stream import RequestStream, start_all
from loomllm.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from loomllm.protocols.messages import Pooling
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from loomllm.engine.engine import Engine

Prompt = str | dict[str, Any]


def embed_params(truncate_prompt_tokens: int | None) -> SamplingParams:
    """An embedding's request: its prompt computed, then one placeholder token sampled
    (the worker's pooling runner puts the embedding beside it), which ends it."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        truncate_prompt_tokens=truncate_prompt_tokens,
    )


def check_dimensions(dimensions: int | None, pooling: Pooling) -> None:
    """ValueError naming `dimensions` unless the model's embedding can be cut to it."""
    if dimensions is None:
        return
    if type(dimensions) is not int or not 1 <= dimensions <= pooling.size:
        raise ValueError(
            f"dimensions must be an integer in [1, {pooling.size}] (the embedding's size), "
            f"got {dimensions!r}"
        )
    if not pooling.matryoshka and dimensions != pooling.size:
        raise ValueError(
            f"dimensions cannot be {dimensions}: this model's embeddings cannot be shortened "
            "(its config.json does not say is_matryoshka or matryoshka_dimensions)"
        )


def embedding_output(
    final: RequestOutput, dimensions: int | None, pooling: Pooling
) -> EmbeddingRequestOutput:
    """The final output's embedding, cut to `dimensions` (normalized again where the model
    normalizes), as vLLM's EmbeddingRequestOutput."""
    if final.pooled is None:
        raise RuntimeError(f"request {final.request_id!r} ended without an embedding (aborted)")
    vector = final.pooled.tolist()
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        if pooling.normalize:
            norm = math.sqrt(sum(v * v for v in vector)) or 1.0
            vector = [v / norm for v in vector]
    return EmbeddingRequestOutput(
        final.request_id, EmbeddingOutput(vector), final.prompt_token_ids, True
    )


def texts_of(text: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One text or a list of them, as a list."""
    return [text] if isinstance(text, str | dict) else list(text)


def score_pairs(first: list[Prompt], second: list[Prompt]) -> list[tuple[int, int]]:
    """vLLM's pairing of score()'s texts, as (index in text_1, index in text_2): one first
    text against each second one, or the two lists pair by pair."""
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(first) == 1:
        return [(0, j) for j in range(len(second))]
    if len(first) != len(second):
        raise ValueError(
            f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2"
        )
    return [(i, i) for i in range(len(first))]


async def score_by_cosine(
    engine: Engine, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt]
) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity (a bi-encoder's score), its texts embedded together;
    a bad text raises ValueError before anything is scheduled."""
    first, second = texts_of(text_1), texts_of(text_2)
    pairs = score_pairs(first, second)
    texts = first + second
    finals = await finals_of(start_all(partial(engine.embed_stream, t) for t in texts))
    vectors = [engine.embedding(final, None) for final in finals]
    outputs = []
    for i, j in pairs:
        a, b = vectors[i], vectors[len(first) + j]
        outputs.append(
            ScoringRequestOutput(
                f"{a.request_id}-{b.request_id}",
                ScoringOutput(_cosine(a.outputs.embedding, b.outputs.embedding)),
                a.prompt_token_ids + b.prompt_token_ids,
            )
        )
    return outputs


async def finals_of(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each started FINAL_ONLY stream's one output, read together; if one fails, the others
    are aborted (their streams left) and its error raised."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def one(index: int) -> None:
        async with streams[index]:
            finals[index] = await anext(streams[index])

    async with anyio.create_task_group() as tg:
        for index in range(len(streams)):
            tg.start_soon(one, index)
    return [final for final in finals if final is not None]  # each task set its own or raised


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0
