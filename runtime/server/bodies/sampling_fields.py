"""The fields completions and chat share: SamplingParams' own, made from its FieldSpecs, and
the server's (stop, bad words, logit bias, structured outputs, streaming, priority)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator, model_validator

from loomllm.protocols.sampling import FieldSpec, field_specs
from loomllm.server.bodies.body_error import BodyError
from loomllm.server.bodies.json_types import (
    BODY_CONFIG,
    JsonInt,
    JsonNumber,
    PositiveInt,
    Text,
    body_config,
    json_int,
    limit,
)

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_BAD_WORDS = 1000  # the workers check each one's sequences at every step
MAX_BAD_WORD_CHARS = 200  # each is encoded in the engine's loop
# A logit_bias key: a token id in ASCII digits, 64 bits' reach at most.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,18}")
# vLLM's older names for structured_outputs' fields, still sent by its clients.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _spec_field(scalar: type, is_list: bool, rule: FieldSpec) -> tuple[Any, Any]:
    """A body field of SamplingParams' field with `rule`: null means absent, as everywhere."""
    high = rule.high if rule.body_high is None else rule.body_high
    bounds: dict[str, Any] = {}
    if rule.low is not None:
        bounds["gt" if rule.low_open else "ge"] = rule.low
    if high is not None:
        bounds["le"] = high
    kind: Any = bool
    if scalar is int:
        kind = json_int(**bounds)  # an int's low bound is never open
    elif scalar is float:
        kind = Annotated[JsonNumber, Field(**bounds)]
    if rule.token_ids:
        kind = Annotated[kind, limit("token_id")]
    if is_list:
        kind = Annotated[list[kind], Field(min_length=rule.min_items)]  # type: ignore[valid-type]
    return kind | None, Field(None, description=rule.doc or None)


class StreamOptions(BaseModel):
    model_config = BODY_CONFIG
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk carries its prompt's and choice's tokens so far.
    continuous_usage_stats: bool | None = None


class JsonSchemaSpec(BaseModel):
    model_config = BODY_CONFIG
    name: str = ""
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = BODY_CONFIG
    type: Literal["text", "json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = BODY_CONFIG
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class _Grammar(BaseModel):
    """One of vLLM's structured_outputs: exactly one field."""

    model_config = body_config(**{"extra": "forbid"})


class JsonGrammar(_Grammar):
    json_: dict[str, Any] | Text | bool = Field(alias="json", description="a JSON schema")


class JsonObjectGrammar(_Grammar):
    json_object: Literal[True]


class RegexGrammar(_Grammar):
    regex: Text


class ChoiceGrammar(_Grammar):
    choice: Annotated[list[Text], Field(min_length=1)]


class EbnfGrammar(_Grammar):
    grammar: Text = Field(description="EBNF (xgrammar's dialect)")


Grammar = JsonGrammar | JsonObjectGrammar | RegexGrammar | ChoiceGrammar | EbnfGrammar
_Bias = Annotated[JsonNumber, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
_BadWord = Annotated[str, Field(pattern=r"\S", max_length=MAX_BAD_WORD_CHARS)]
# A non-empty stream_options needs stream: true (JSON Schema's statement of the rule).
STREAM_OPTIONS_RULE = {
    "if": {
        "properties": {"stream_options": {"type": "object", "minProperties": 1}},
        "required": ["stream_options"],
    },
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
}


class _ServerSampling(BaseModel):
    """The sampling fields the server reads itself (SamplingParams' are added below)."""

    model_config = body_config(**{"json_schema_extra": {"allOf": [STREAM_OPTIONS_RULE]}})

    model: str | None = Field(None, json_schema_extra={"x-loom-limit": "model"})
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: Text | list[Text] | None = None
    bad_words: Annotated[list[_BadWord], Field(max_length=MAX_BAD_WORDS)] | None = None
    logit_bias: dict[str, _Bias] | None = Field(
        None,
        description="{token id: added to its logit}; -100 all but bans it, 100 all but forces it",
        json_schema_extra={"x-loom-limit": "token_id_keys"},
    )
    response_format: TextFormat | JsonSchemaFormat | None = None
    structured_outputs: Grammar | None = Field(
        None,
        description="vLLM's: exactly one of json (a schema), json_object, regex, choice, "
        "grammar (EBNF); one that does not compile: 400",
    )
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    priority: JsonInt | None = Field(
        None, description="lower runs first", json_schema_extra={"x-loom-limit": "priority"}
    )
    return_tokens_as_token_ids: bool | None = Field(
        None, description="logprobs' tokens as token_id:<id>"
    )
    truncate_prompt_tokens: Annotated[PositiveInt, limit("context")] | Literal[-1] | None = Field(
        None, description="keep the prompt's last k tokens; -1: max_model_len - 1"
    )
    # OpenAI fields this server does not implement, at the values that ask for nothing
    # (OpenAI's SDKs and frameworks may send them); any other value: 400.
    functions: Annotated[list[Any], Field(max_length=0)] | None = Field(
        None, description="unsupported: only a value that asks for nothing"
    )
    function_call: Literal["none"] | None = Field(
        None, description="unsupported: only a value that asks for nothing"
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise BodyError(
                    f"logit_bias keys must be token ids, got {key!r}"[:300], "logit_bias"
                )
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _ServerSampling:
        if self.stream_options is not None and self.stream_options.model_fields_set:
            if not self.stream:
                raise BodyError(
                    "stream_options is only allowed with stream: true", "stream_options"
                )
        return self


_SPECS = {name: args for name, args in field_specs().items() if args[3].in_body}
if TYPE_CHECKING:
    SamplingBody = _ServerSampling
else:
    SamplingBody = create_model(
        "SamplingBody",
        __base__=_ServerSampling,
        **{
            name: _spec_field(scalar, is_list, rule)
            for name, (scalar, _, is_list, rule) in _SPECS.items()
        },
    )


def engine_fields(body: BaseModel) -> dict[str, Any]:
    """The body's SamplingParams fields that it sets, as SamplingParams takes them."""
    return {name: v for name in _SPECS if (v := getattr(body, name)) is not None}
