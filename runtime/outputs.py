"""What a request's stream yields: RequestOutput and CompletionOutput, named as in vLLM.

Also the per-request collector that hands outputs from the step loop to the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from loomllm.protocols.sampling import RequestOutputKind

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when not among the returned top tokens
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the tokens' summed logprobs, if logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token, if asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it); each holds the token's own Logprob (with its rank) and the
    # top-k of the distribution predicted at the position before. Set from the first output
    # on (DELTA: in the first output only); None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # runner="pooling": the prompt's embedding, [size] float32, in the final output
    # (Engine.embed hands it out as an EmbeddingRequestOutput).
    pooled: np.ndarray | None = None

    def merge_delta(self, newer: RequestOutput) -> None:
        """Fold a later DELTA output into this one (the consumer has not taken this yet)."""
        by_index = {c.index: c for c in self.outputs}
        for c in newer.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if mine.logprobs is not None and c.logprobs is not None:
                mine.logprobs = mine.logprobs + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        self.finished, self.metrics = newer.finished, newer.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = newer.prompt_logprobs
        if self.pooled is None:
            self.pooled = newer.pooled
        self.num_cached_tokens = newer.num_cached_tokens


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's: `.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label: softmax over the labels (sigmoid for a single one)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """One prompt's class probabilities, as vLLM's: `.outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """One pair's score, as vLLM's: `.outputs.score` (a bi-encoder's: the cosine similarity
    of the two texts' embeddings; a cross-encoder's: its logit for the pair, activated)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[
        int
    ]  # the first text's, then the second's (a cross-encoder's: the pair's)
    finished: bool = True


@dataclass(eq=False)
class RequestOutputCollector:
    """Holds at most one pending output (or error) for a consumer; never blocks the producer.

    The step loop must never wait on a slow consumer, so outputs that pile up are merged
    (DELTA) or replaced (the other kinds), as vLLM's RequestOutputCollector does.
    """

    output_kind: RequestOutputKind
    _pending: RequestOutput | BaseException | None = None
    _ready: anyio.Event = field(default_factory=anyio.Event)

    def put(self, output: RequestOutput | BaseException) -> None:
        pending = self._pending
        if (
            isinstance(pending, RequestOutput)
            and isinstance(output, RequestOutput)
            and self.output_kind == RequestOutputKind.DELTA
        ):
            pending.merge_delta(output)
        elif not isinstance(pending, BaseException):  # an error is final: keep it
            self._pending = output
        self._ready.set()

    async def get(self) -> RequestOutput:
        """Wait for the next output; raise the error put instead, if any.

        Cancellation: nothing is taken; a later get() returns the output.
        """
        await self._ready.wait()
        pending = self._pending
        if isinstance(pending, BaseException):
            raise pending
        assert pending is not None
        self._pending = None
        self._ready = anyio.Event()
        return pending
