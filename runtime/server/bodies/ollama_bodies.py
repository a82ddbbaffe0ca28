"""Ollama's request bodies: /api/generate, /api/chat, /api/embed, /api/show and /api/pull."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from loomllm.server.bodies.body_error import BodyError
from loomllm.server.bodies.json_types import (
    BODY_CONFIG,
    JsonNumber,
    PositiveInt,
    Text,
    body_config,
)


def no_images(images: list[str] | None, where: str) -> None:
    if images:
        raise BodyError(f"{where}: this server's model reads text only", where)


class OllamaBody(BaseModel):
    """A body that names its model, and how long it stays loaded after."""

    model_config = BODY_CONFIG
    model: Text
    # Seconds (negative: forever) or a duration ("5m"): keep_alive.py reads it.
    keep_alive: JsonNumber | str | None = None


class GeneratingBody(OllamaBody):
    stream: bool | None = None  # Ollama streams unless told not to
    options: dict[str, Any] | None = None  # ollama/options.py reads them
    format: Literal["json", ""] | dict[str, Any] | None = None  # "json" or a JSON schema


class GenerateBody(GeneratingBody):
    prompt: str = ""  # empty: load (or unload) the model only
    images: list[str] | None = None
    system: str | None = None
    raw: bool | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, images: list[str] | None) -> list[str] | None:
        no_images(images, "images")
        return images


class OllamaMessage(BaseModel):
    """A chat message; its other fields reach the chat template as sent."""

    model_config = body_config(**{"extra": "allow"})
    role: Text
    content: str = ""
    images: list[str] | None = None


class OllamaChatBody(GeneratingBody):
    messages: list[OllamaMessage] = []  # none: load (or unload) the model only
    tools: list[Any] | None = None

    @field_validator("messages")
    @classmethod
    def _text_only(cls, messages: list[OllamaMessage]) -> list[OllamaMessage]:
        for i, message in enumerate(messages):
            no_images(message.images, f"messages[{i}].images")
        return messages

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None) -> list[Any] | None:
        if tools:
            raise BodyError(
                "tools are not supported on /api/chat yet: use /v1/chat/completions", "tools"
            )
        return tools

    def raw_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_unset=True, exclude={"images"}) for m in self.messages]


class EmbedBody(OllamaBody):
    input: Text | Annotated[list[Text], Field(min_length=1)]
    truncate: bool | None = None  # default true: cut to the context
    dimensions: PositiveInt | None = None


class PullBody(BaseModel):
    model_config = BODY_CONFIG
    model: Text | None = None
    name: Text | None = None  # Ollama's older name for model
    stream: bool | None = None
