"""What a chat body holds besides sampling: its messages, tools and chat-template fields
(vLLM's extras), shared by /v1/chat/completions and /tokenize."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from loomllm.server.bodies.body_error import BodyError
from loomllm.server.bodies.json_types import (
    BODY_CONFIG,
    Text,
    body_config,
    limit,
)

MAX_TOOLS = 128  # OpenAI's limit; a "required" grammar over thousands compiles far too slowly
# Names the template sees from the body's own fields: chat_template_kwargs cannot set them
# (chat_template there would pass a template past --trust-request-chat-template).
RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
    }
)


class TextPart(BaseModel):
    model_config = BODY_CONFIG
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message; its other fields (name, tool_call_id, ...) reach the template as sent."""

    model_config = body_config(
        **{
            "extra": "allow",
            # content may be null or absent only in a message with tool_calls
            "json_schema_extra": {
                "anyOf": [
                    {
                        "properties": {"content": {"type": ["string", "array"]}},
                        "required": ["content"],
                    },
                    {
                        "properties": {"tool_calls": {"not": {"type": "null"}}},
                        "required": ["tool_calls"],
                    },
                ]
            },
        }
    )
    role: Text
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and self.tool_calls is None:
            raise BodyError("messages: each message needs content, or tool_calls", "messages")
        return self


class FunctionDef(BaseModel):
    model_config = BODY_CONFIG
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = BODY_CONFIG
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = BODY_CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = BODY_CONFIG
    type: Literal["function"]
    function: FunctionName


_NOT_RESERVED: Any = {"propertyNames": {"not": {"enum": sorted(RESERVED_VARIABLES)}}}
# continue_final_message needs add_generation_prompt: false, which defaults to true.
CONTINUE_RULE = {
    "if": {
        "properties": {"continue_final_message": {"const": True}},
        "required": ["continue_final_message"],
    },
    "then": {
        "properties": {"add_generation_prompt": {"const": False}},
        "required": ["add_generation_prompt"],
    },
}


class TemplateBody(BaseModel):
    """The chat-template fields; what the server allows of them: chat_template_fields.py."""

    model_config = body_config(**{"json_schema_extra": {"allOf": [CONTINUE_RULE]}})
    add_generation_prompt: bool | None = Field(None, description="default true")
    continue_final_message: bool | None = Field(
        None,
        description="go on with the final message's text (with add_generation_prompt: false)",
    )
    chat_template: Annotated[Text, limit("chat_template")] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="the chat template's variables",
        json_schema_extra=_NOT_RESERVED,
    )
    documents: list[dict[str, Any]] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, variables: dict[str, Any] | None) -> dict[str, Any] | None:
        if reserved := sorted(RESERVED_VARIABLES.intersection(variables or ())):
            raise BodyError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: send the body's own field",
                "chat_template_kwargs",
            )
        return variables

    @model_validator(mode="after")
    def _continue_needs_no_new_message(self) -> TemplateBody:
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise BodyError(
                "continue_final_message goes on with the final message, add_generation_prompt "
                "starts a new one: set add_generation_prompt to false",
                "continue_final_message",
            )
        return self


class ToolsBody(BaseModel):
    """Chat's tool fields; tool_calls.py reads them."""

    model_config = BODY_CONFIG
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"required" or a named function: the answer is tool_calls, generated '
        'under the tools\' schemas; "auto": calls read out of the answer (with '
        "--enable-auto-tool-choice, else 400)",
    )
    parallel_tool_calls: bool | None = None
