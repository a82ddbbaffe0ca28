"""OpenAI's generation bodies (and vLLM's tokenize, detokenize): /v1/completions,
/v1/chat/completions, /tokenize, /detokenize."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from loomllm.protocols.sampling import MAX_LOGPROBS
from loomllm.server.bodies.body_error import BodyError
from loomllm.server.bodies.chat_fields import CONTINUE_RULE, Message, TemplateBody, ToolsBody
from loomllm.server.bodies.json_types import (
    BODY_CONFIG,
    INTEGRAL,
    PositiveInt,
    TokenId,
    TokenIds,
    body_config,
    limit,
)
from loomllm.server.bodies.sampling_fields import STREAM_OPTIONS_RULE, SamplingBody

_Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]
# A text prompt; its token count is only known once encoded (openapi_schemas.py says so).
PromptText = Annotated[str, limit("prompt_text")]
Prompt = (
    PromptText
    | Annotated[list[PromptText], Field(min_length=1)]
    | Annotated[TokenIds, limit("prompt_ids")]
    | Annotated[list[Annotated[TokenIds, limit("prompt_ids")]], Field(min_length=1)]
)


class CompletionBody(SamplingBody):
    prompt: Prompt
    max_tokens: PositiveInt | None = Field(
        None, description="default 16; output stops at max_model_len"
    )
    echo: bool | None = None
    logprobs: _Logprobs | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = Field(None, description="unsupported")
    tools: Annotated[list[Any], Field(max_length=0)] | None = Field(None, description="chat only")
    tool_choice: Literal["none"] | None = Field(None, description="chat only")


_TOP_LOGPROBS_RULE = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatBody(SamplingBody, TemplateBody, ToolsBody):
    model_config = body_config(
        **{
            "json_schema_extra": {
                "allOf": [
                    STREAM_OPTIONS_RULE,
                    CONTINUE_RULE,
                    _TOP_LOGPROBS_RULE,
                ]
            }
        }
    )
    messages: Annotated[list[Message], Field(min_length=1), limit("messages")]
    max_completion_tokens: PositiveInt | None = Field(
        None, description="default: up to max_model_len"
    )
    max_tokens: PositiveInt | None = Field(
        None, description="used when max_completion_tokens is absent"
    )
    logprobs: bool | None = None
    top_logprobs: _Logprobs | None = Field(None, description="only with logprobs: true")
    echo: bool | None = Field(
        None,
        description="the answer starts with the final message's text when that is the assistant's",
    )

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatBody:
        if self.top_logprobs is not None and not self.logprobs:
            raise BodyError("top_logprobs needs logprobs: true", "top_logprobs")
        return self


class TokenizeBody(TemplateBody):
    model_config = body_config(
        **{
            "json_schema_extra": {
                "allOf": [CONTINUE_RULE],
                "anyOf": [
                    {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
                    {
                        "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                        "required": ["prompt"],
                    },
                ],
            }
        }
    )
    model: str | None = Field(None, json_schema_extra={"x-loom-limit": "model"})
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1), limit("messages")] | None = None
    add_special_tokens: bool | None = Field(None, description="for prompt; messages never add them")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if self.messages is None and self.prompt is None:
            raise BodyError("prompt (a string) or messages is required", "prompt")
        return self


class DetokenizeBody(BaseModel):
    model_config = BODY_CONFIG
    model: str | None = Field(None, json_schema_extra={"x-loom-limit": "model"})
    tokens: list[TokenId]


def raw_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: as sent, with their other fields."""
    return [m.model_dump(exclude_unset=True) for m in messages]
