"""The pooling runner's requests on an Engine (runner="pooling"): embeddings, classification
and scores, as vLLM's LLM.embed, classify and score."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from loomllm.engine.classification import (
    classification_output,
    is_classifier,
    score_by_cross_encoder,
)
from loomllm.engine.embedding import (
    check_dimensions,
    embed_params,
    embedding_output,
    score_by_cosine,
)
from loomllm.engine.request_stream import RequestStream
from loomllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from loomllm.protocols.messages import Pooling

if TYPE_CHECKING:
    from loomllm.config import EngineConfig
    from loomllm.engine.engine import Engine
    from loomllm.protocols.lora import LoRARequest
    from loomllm.protocols.messages import ModelInfo
    from loomllm.protocols.sampling import SamplingParams


class PoolingRequests:
    """Engine's pooling methods; they submit through the Engine's own request path."""

    if TYPE_CHECKING:  # what they use of the Engine they are part of
        config: EngineConfig

        @property
        def model_info(self) -> ModelInfo: ...

        def _require_running(self) -> None: ...

        def _submit(
            self,
            prompt: str | dict[str, Any],
            params: SamplingParams,
            request_id: str | None,
            priority: int,
            max_tokens_must_fit: bool,
            lora_request: LoRARequest | None = None,
        ) -> RequestStream: ...

    async def embed(
        self,
        prompt: str | dict[str, Any],
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput:
        """The prompt's embedding (runner="pooling" only), as vLLM's EmbeddingRequestOutput:
        `.outputs.embedding`. It is scheduled as a prompt among the others, pooled as the
        model says (models/pooling.py). `dimensions` cuts a Matryoshka model's embedding.
        Bad input raises ValueError naming the field, before anything is scheduled."""
        stream = self.embed_stream(
            prompt,
            dimensions=dimensions,
            truncate_prompt_tokens=truncate_prompt_tokens,
            request_id=request_id,
            priority=priority,
        )
        async with stream:  # FINAL_ONLY: one output, the last; leaving early aborts it
            final = await anext(stream)
        return self.embedding(final, dimensions)

    def embed_stream(
        self,
        prompt: str | dict[str, Any],
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """`embed`'s request, started: its stream's one output goes to `embedding`."""
        pooling = self._pooling()
        if is_classifier(pooling):
            raise ValueError(
                f"model {self.config.model!r} is a classifier: it classifies (classify) and "
                "scores pairs (score), it does not embed"
            )
        check_dimensions(dimensions, pooling)
        return self.pooled_stream(
            prompt,
            truncate_prompt_tokens=truncate_prompt_tokens,
            request_id=request_id,
            priority=priority,
        )

    def pooled_stream(
        self,
        prompt: str | dict[str, Any],
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """A pooling request, started: its stream's one output holds what the worker pooled
        (an embedding, or a classifier's logits). A prompt dict may carry `token_type_ids`
        beside its ids, an encoder's segments (a pair of texts)."""
        self._pooling()
        return self._submit(
            prompt, embed_params(truncate_prompt_tokens), request_id, priority, False
        )

    async def classify(
        self,
        prompt: str | dict[str, Any],
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> ClassificationRequestOutput:
        """The prompt's class probabilities (a classifier with runner="pooling"), as vLLM's
        ClassificationRequestOutput: `.outputs.probs`, one per label."""
        async with self.classify_stream(prompt, request_id=request_id, priority=priority) as s:
            final = await anext(s)
        return classification_output(final)

    def classify_stream(
        self,
        prompt: str | dict[str, Any],
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """`classify`'s request, started: its stream's one output goes to `classification`."""
        if not is_classifier(self._pooling()):
            raise ValueError(
                f"model {self.config.model!r} has no classification head: it embeds (embed)"
            )
        return self.pooled_stream(prompt, request_id=request_id, priority=priority)

    @staticmethod
    def classification(final: RequestOutput) -> ClassificationRequestOutput:
        """A `classify_stream`'s output as vLLM's ClassificationRequestOutput."""
        return classification_output(final)

    async def score(
        self,
        text_1: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        text_2: str | dict[str, Any] | Sequence[str | dict[str, Any]],
    ) -> list[ScoringRequestOutput]:
        """vLLM's score (runner="pooling"): one text_1 against each text_2, or the two lists
        pair by pair. A cross-encoder (a classifier) reads each pair as one input; another
        model scores it by the cosine similarity of the two embeddings."""
        if is_classifier(self._pooling()):
            return await score_by_cross_encoder(cast("Engine", self), text_1, text_2)
        return await score_by_cosine(cast("Engine", self), text_1, text_2)

    def _pooling(self) -> Pooling:
        """The model's pooling; ValueError unless the engine runs with runner="pooling"."""
        self._require_running()
        pooling = self.model_info.pooling
        if pooling is None:
            raise ValueError(
                f"model {self.config.model!r} runs with runner='generate': start the engine "
                "with runner='pooling' to embed, classify or score"
            )
        return pooling

    def embedding(self, final: RequestOutput, dimensions: int | None) -> EmbeddingRequestOutput:
        """An `embed_stream`'s output as vLLM's EmbeddingRequestOutput."""
        pooling = self.model_info.pooling
        assert pooling is not None
        return embedding_output(final, dimensions, pooling)
