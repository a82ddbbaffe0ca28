"""Engine.embed's side of a pooling engine: the request it schedules, `dimensions` checked
and applied, and the final output turned into vLLM's EmbeddingRequestOutput.
"""

from __future__ import annotations

import math

from loomllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from loomllm.protocols.messages import Pooling
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams


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
