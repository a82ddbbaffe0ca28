"""OpenAI request bodies, validated by their models (runtime/server/bodies/), as
SamplingParams and plain fields; what only the server can tell is a 400 naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from dataclasses import field as field_of
from typing import Any

from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.sampling import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    replace_checked,
)
from loomllm.server.bodies.openai_bodies import ChatBody, CompletionBody, raw_messages
from loomllm.server.bodies.sampling_fields import (
    GUIDED_FIELDS,
    JsonSchemaFormat,
    SamplingBody,
    engine_fields,
)
from loomllm.server.openai.api_error import ApiError, bad
from loomllm.server.openai.chat_template_fields import (
    TemplateFields,
    echoed_text,
    parse_template_fields,
)
from loomllm.server.openai.tool_calls import ToolCalls, parse_tools

MAX_MESSAGE_CHARS = 1000


def from_value_error(exc: ValueError, default_param: str, renames: dict[str, str]) -> ApiError:
    """A ValueError whose message starts with a field name, as a 400 naming that field.

    Only names in `renames` or SamplingParams' fields count; else `default_param`.
    """
    message = str(exc)
    first = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    if first in renames or first in SamplingParams.__dataclass_fields__:
        param = renames.get(first, first)
        message = param + message[len(first) :] if param != first else message
    else:
        param = default_param
    if not message.startswith(param):
        message = f"{param}: {message}"
    return bad(message[:MAX_MESSAGE_CHARS], param)  # it may quote a huge value


@dataclass(slots=True)
class Common:
    """What completions and chat share besides the prompt."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    # The body field that asked for structured outputs: a grammar the workers cannot
    # compile is a 400 naming it.
    structured_field: str | None = None
    priority: int = 0  # vLLM's extra: lower first (--scheduling-policy priority)
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    # its prompt's tokens and its choice's tokens so far.
    continuous_usage: bool = False
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:5" in logprobs
    # The LoRA adapter the request's `model` names (set by the app); None: the base model.
    lora: LoRARequest | None = None


def structured_outputs(body: SamplingBody) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar asked for by response_format, vLLM's structured_outputs, or its guided_*
    fields (one of them at most), and the field that asked."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = body.response_format
    if isinstance(response_format, JsonSchemaFormat):
        asked.append(("response_format", {"json": response_format.json_schema.schema_}))
    elif response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs.model_dump(by_alias=True)))
    for name, key in GUIDED_FIELDS.items():
        if (value := getattr(body, name)) is not None:
            asked.append((name, {key: value}))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad(f"ask for one output format at most, got {names}", asked[1][0])
    name, kwargs = asked[0]
    try:
        return StructuredOutputsParams(**kwargs), name
    except ValueError as exc:
        message = as_field(str(exc), name)
        if not message.startswith(name):
            message = f"{name}: {message}"
        raise bad(message[:MAX_MESSAGE_CHARS], name) from None


def parse_common(
    body: SamplingBody,
    max_tokens: int | None,
    logprobs: int | None,
    renames: dict[str, str],
    stream_kind: RequestOutputKind = RequestOutputKind.DELTA,
    prompt_logprobs: int | None = None,
    tool_calls: ToolCalls | None = None,
    defaults: dict[str, Any] | None = None,
) -> Common:
    """`defaults`: sampling fields for those the body leaves out (the model's own); its
    max_tokens also caps the body's, as vLLM caps it."""
    defaults = dict(defaults or {})
    if (default_max := defaults.pop("max_tokens", None)) is not None:
        max_tokens = default_max if max_tokens is None else min(max_tokens, default_max)
    stream = bool(body.stream)
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    kwargs = {**defaults, **engine_fields(body)}
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.bad_words is not None:
        kwargs["bad_words"] = body.bad_words  # SamplingParams checks each
    if body.logit_bias:
        kwargs["logit_bias"] = {int(key): bias for key, bias in body.logit_bias.items()}
    if body.truncate_prompt_tokens is not None:
        kwargs["truncate_prompt_tokens"] = body.truncate_prompt_tokens
    constraint, structured_field = structured_outputs(body)
    if tool_calls is not None:  # the call tool_choice demands is generated under its schema
        if constraint is not None:
            raise bad(
                f"{structured_field} cannot go with a tool call that tool_choice demands",
                structured_field,
            )
        constraint, structured_field = tool_calls.constraint, "tools"
    kwargs["structured_outputs"] = constraint
    kind = stream_kind if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            logprobs=logprobs,
            output_kind=kind,
            prompt_logprobs=prompt_logprobs,
            **kwargs,
        )
    except ValueError as exc:
        raise from_value_error(exc, "body", renames) from None
    return Common(
        params,
        stream,
        include_usage,
        structured_field,
        body.priority or 0,
        include_usage and continuous,
        bool(body.return_tokens_as_token_ids),
    )


def as_field(message: str, field: str) -> str:
    """A message naming StructuredOutputsParams' fields ("structured_outputs.json is not
    JSON", from a worker too) as naming `field`, the body's field that asked (guided_json)."""
    if field == "structured_outputs":
        return message
    return re.sub(r"^structured_outputs(\.\w+)?", field, message)


@dataclass(slots=True)
class CompletionRequest:
    prompts: list[str | dict[str, Any]]  # each a string or {"prompt_token_ids": [...]}
    echo: bool
    common: Common


def parse_completion(
    body: CompletionBody, defaults: dict[str, Any] | None = None
) -> CompletionRequest:
    """A completion body; `defaults`: see parse_common."""
    raw = body.prompt
    prompts: list[str | dict[str, Any]]
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw[0], int):
        prompts = [{"prompt_token_ids": raw}]
    else:
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in raw]
    echo = bool(body.echo)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    # echo with logprobs scores the prompt too: its tokens' logprobs come first.
    prompt_logprobs = body.logprobs if echo else None
    common = parse_common(
        body, max_tokens, body.logprobs, {}, prompt_logprobs=prompt_logprobs, defaults=defaults
    )
    return CompletionRequest(prompts, echo, common)


@dataclass(slots=True)
class ChatRequest:
    messages: list[Any]
    common: Common
    want_logprobs: bool
    template: TemplateFields = field_of(default_factory=TemplateFields)
    tools: list[dict[str, Any]] | None = None  # for the chat template
    tool_calls: ToolCalls | None = None  # the calls tool_choice demands
    echo: str = ""  # the text `echo` puts before each choice's answer
    auto_tools: bool = False  # tool_choice "auto": the answer is read for calls
    parallel_tool_calls: bool = True  # false: the first call the model made only
    reasoning_parser: str | None = None  # the answer's reasoning is split out by this one


def parse_chat(
    body: ChatBody,
    template_names: Collection[str] = (),
    trust_templates: bool = False,
    auto_tools: bool = False,
    reasoning_parser: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> ChatRequest:
    """A chat body; `template_names` and `trust_templates`: see parse_template_fields;
    `auto_tools`: the server has a tool-call parser (tool_choice "auto" works);
    `reasoning_parser`: the server's (reasoning.PARSERS), if it splits out reasoning;
    `defaults`: see parse_common."""
    messages = raw_messages(body.messages)
    want_logprobs = bool(body.logprobs)
    logprobs = (body.top_logprobs or 0) if want_logprobs else None
    max_tokens = body.max_completion_tokens
    renames = {"logprobs": "top_logprobs"}
    if max_tokens is None:
        max_tokens = body.max_tokens
    else:
        renames["max_tokens"] = "max_completion_tokens"
    template = parse_template_fields(body, template_names, trust_templates)
    echo = echoed_text(messages) if body.echo else ""
    tools, tool_calls, auto = parse_tools(body, auto_tools)
    common = parse_common(
        body, max_tokens, logprobs, renames, tool_calls=tool_calls, defaults=defaults
    )
    if auto:  # the tags may be special tokens: they must reach the text (vLLM does the same)
        common.params = replace_checked(common.params, skip_special_tokens=False)
    if common.structured_field is not None:
        # A grammar holds from the first token: the model cannot think first, and its
        # answer is all content.
        reasoning_parser = None
    return ChatRequest(
        messages,
        common,
        want_logprobs,
        template,
        tools,
        tool_calls,
        echo,
        auto,
        body.parallel_tool_calls is not False,
        reasoning_parser,
    )
