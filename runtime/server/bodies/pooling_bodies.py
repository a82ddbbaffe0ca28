"""The pooling routes' bodies: /v1/embeddings (OpenAI's), /classify, /v1/score (vLLM's) and
/v1/rerank (Jina's and Cohere's)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from loomllm.server.bodies.body_error import BodyError
from loomllm.server.bodies.json_types import (
    BODY_CONFIG,
    PositiveInt,
    Text,
    TokenIds,
    limit,
)

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
_Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
Inputs = (
    Text
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
)


class PoolingBody(BaseModel):
    model_config = BODY_CONFIG
    model: str | None = Field(None, json_schema_extra={"x-loom-limit": "model"})


class ClassifyBody(PoolingBody):
    input: Inputs = Field(description="a string, token ids, or a list of either")


class EmbeddingBody(ClassifyBody):
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[PositiveInt, limit("dimensions")] | None = Field(
        None, description="a Matryoshka model's: at most its size; another's: its size"
    )
    truncate_prompt_tokens: Annotated[PositiveInt, limit("context")] | None = Field(
        None, description="keep each input's last k tokens"
    )


class ScoreBody(PoolingBody):
    text_1: Text | _Texts = Field(description="one text, or as many as text_2")
    text_2: Text | _Texts

    @model_validator(mode="after")
    def _pairs(self) -> ScoreBody:
        first, second = as_list(self.text_1), as_list(self.text_2)
        if len(first) not in (1, len(second)):
            raise BodyError(
                f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, "
                "or as many as text_2",
                "text_1",
            )
        return self


class RerankBody(PoolingBody):
    query: Text
    documents: _Texts
    top_n: PositiveInt | None = Field(None, description="default: all")
    return_documents: bool | None = None


def as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts
