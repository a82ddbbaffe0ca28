"""Engine.classify and a cross-encoder's Engine.score on a classifier (a BERT-family
`*ForSequenceClassification` with runner="pooling"): the worker sends its head's logits, and
this side turns them into vLLM's ClassificationRequestOutput or a pair's score."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from loomllm.engine.embedding import Prompt, finals_of, score_pairs, texts_of
from loomllm.engine.request_stream import start_all
from loomllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from loomllm.protocols.messages import Pooling

if TYPE_CHECKING:
    from loomllm.engine.engine import Engine


def is_classifier(pooling: Pooling | None) -> bool:
    return pooling is not None and pooling.method == "classify"


def logits_of(final: RequestOutput) -> list[float]:
    if final.pooled is None:
        raise RuntimeError(f"request {final.request_id!r} ended without logits (aborted)")
    return [float(v) for v in final.pooled.tolist()]


def classification_output(final: RequestOutput) -> ClassificationRequestOutput:
    """The final output's logits as probabilities: softmax over the labels, or the sigmoid
    of a single one (as vLLM's classify)."""
    logits = logits_of(final)
    if len(logits) == 1:
        probs = [_sigmoid(logits[0])]
    else:
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [e / sum(exps) for e in exps]
    return ClassificationRequestOutput(
        final.request_id, ClassificationOutput(probs), final.prompt_token_ids, True
    )


async def score_by_cross_encoder(
    engine: Engine, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt]
) -> list[ScoringRequestOutput]:
    """Each pair read as one input by the cross-encoder, its one logit activated as
    sentence-transformers' CrossEncoder does; a bad text raises ValueError before anything
    is scheduled."""
    pooling = engine.model_info.pooling
    assert pooling is not None
    if pooling.size != 1:
        raise ValueError(
            f"score needs a cross-encoder with one label; this classifier has {pooling.size}: "
            "use classify"
        )
    first, second = texts_of(text_1), texts_of(text_2)
    pairs = score_pairs(first, second)
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    prompts = []
    for i, j in pairs:
        a, b = first[i], second[j]
        if not isinstance(a, str) or not isinstance(b, str):
            raise ValueError("a cross-encoder scores pairs of texts: give strings")
        ids, types = tokenizer.encode_pair(a, b)
        prompts.append({"prompt_token_ids": ids, "token_type_ids": types})
    finals = await finals_of(start_all(partial(engine.pooled_stream, p) for p in prompts))
    outputs = []
    for final in finals:
        logit = logits_of(final)[0]
        score = _sigmoid(logit) if pooling.score_activation == "sigmoid" else logit
        outputs.append(
            ScoringRequestOutput(final.request_id, ScoringOutput(score), final.prompt_token_ids)
        )
    return outputs


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
