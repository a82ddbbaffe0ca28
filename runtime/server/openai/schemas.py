"""OpenAI request bodies parsed into SamplingParams and plain fields; bad input: ApiError(400).

Hand-written so that each check names the field (as `param` too); engine ValueErrors map here.
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
from loomllm.server.openai.api_error import ApiError, bad
from loomllm.server.openai.chat_template_fields import (
    TemplateFields,
    echoed_text,
    parse_template_fields,
)
from loomllm.server.openai.tool_calls import ToolCalls, parse_tools

# Body fields passed to SamplingParams as they are (vLLM's extras included).
_SAMPLING_FIELDS = {
    "temperature": "number",
    "top_p": "number",
    "n": "int",
    "seed": "int",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "top_k": "int",
    "min_p": "number",
    "repetition_penalty": "number",
    "ignore_eos": "bool",
    "min_tokens": "int",
    "stop_token_ids": "int_list",
    "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool",
    "allowed_token_ids": "int_list",
    "truncate_prompt_tokens": "int",
}
# OpenAI fields this server does not implement, each with the values that ask for nothing
# (accepted, as OpenAI's SDKs and frameworks may send them); any other value: 400, rather
# than an answer that silently ignores it.
UNSUPPORTED: dict[str, list[Any]] = {
    "functions": [[]],
    "function_call": ["none"],
}  # (tools: tool_calls.py)
# vLLM's older names for structured_outputs' fields, still sent by its clients.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # choices per prompt: more would flood the batch
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_BAD_WORDS = 1000  # the workers check each one's sequences at every step
MAX_BAD_WORD_CHARS = 200  # each is encoded in the engine's loop
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id, in ASCII digits
MAX_MESSAGE_CHARS = 1000
_KIND_WORDS = {
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "str": "a string",
    "int_list": "a list of integers",
    "dict": "an object",
    "list": "a list",
}


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


def field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against `kind`; `default` when absent or null."""
    value: Any = body.get(name)
    if value is None:
        return default
    if kind == "int":
        value = as_int(value)
    elif kind == "int_list" and isinstance(value, list):
        value = [as_int(v) for v in value]
    ok = {
        "int": type(value) is int,
        "number": type(value) in (int, float),
        "bool": type(value) is bool,
        "str": isinstance(value, str),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
        "int_list": isinstance(value, list) and all(type(v) is int for v in value),
    }[kind]
    if not ok:
        raise bad(f"{name} must be {_KIND_WORDS[kind]}, got {value!r}"[:300], name)
    if kind == "number" and type(value) is int:
        # A float from here on: an integer past 64 bits could not cross to the workers.
        try:
            value = float(value)
        except OverflowError:
            raise bad(f"{name} must be a finite number", name) from None
    if kind in ("int", "int_list") and not all(
        _INT64_MIN <= v <= _INT64_MAX for v in (value if kind == "int_list" else [value])
    ):  # msgpack carries 64-bit integers only: a bigger one must not reach the engine
        raise bad(f"{name} must fit in 64 bits", name)
    return value


def as_int(value: Any) -> Any:
    """An integral float as the int it is (JSON has one number type: 3.0 is 3), else `value`."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


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


def structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar asked for by response_format, vLLM's structured_outputs, or its guided_*
    fields (one of them at most), and the field that asked."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = field(body, "response_format", "dict")
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad(
                    "response_format.json_schema.schema must be a JSON schema (an object)",
                    "response_format",
                )
            assert isinstance(spec, dict)
            strict = spec.get("strict")
            if not isinstance(spec.get("name", ""), str) or not (
                strict is None or isinstance(strict, bool)
            ):
                raise bad(
                    "response_format.json_schema: name must be a string, strict true or false",
                    "response_format",
                )
            asked.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad(
                'response_format.type must be "text", "json_object" or "json_schema"',
                "response_format",
            )
    given = field(body, "structured_outputs", "dict")
    if given is not None:
        if len(given) != 1 or None in given.values():
            raise bad(
                "structured_outputs must set exactly one of json, json_object, regex, "
                "choice, grammar",
                "structured_outputs",
            )
        asked.append(("structured_outputs", given))
    for name, key in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            asked.append((name, {key: body[name]}))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad(f"ask for one output format at most, got {names}", asked[1][0])
    name, kwargs = asked[0]
    try:
        if not set(kwargs) <= set(StructuredOutputsParams.__dataclass_fields__):
            raise ValueError(f"its fields are {', '.join(StructuredOutputsParams.__slots__)}")
        return StructuredOutputsParams(**kwargs), name
    except (TypeError, ValueError) as exc:
        message = as_field(str(exc), name)
        if not message.startswith(name):
            message = f"{name}: {message}"
        raise bad(message[:MAX_MESSAGE_CHARS], name) from None


def parse_common(
    body: dict[str, Any],
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
    for name, no_ops in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in no_ops:
            raise bad(f"{name} is not supported by this server", name)
    stream = field(body, "stream", "bool", False)
    options = field(body, "stream_options", "dict", {})
    if options and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    include_usage = options.get("include_usage")
    include_usage = False if include_usage is None else include_usage  # null: absent
    continuous = options.get("continuous_usage_stats")
    continuous = False if continuous is None else continuous
    if type(include_usage) is not bool or type(continuous) is not bool:
        raise bad(
            "stream_options.include_usage and continuous_usage_stats must be true or false",
            "stream_options",
        )
    kwargs = {
        name: v
        for name, kind in _SAMPLING_FIELDS.items()
        if (v := field(body, name, kind)) is not None
    }
    kwargs = {**defaults, **kwargs}
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop must be a non-empty string or a list of them", "stop")
        kwargs["stop"] = stop
    words = body.get("bad_words")
    if words is not None:
        if (
            not isinstance(words, list)
            or len(words) > MAX_BAD_WORDS
            or any(isinstance(w, str) and len(w) > MAX_BAD_WORD_CHARS for w in words)
        ):
            raise bad(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} words of at most "
                f"{MAX_BAD_WORD_CHARS} characters",
                "bad_words",
            )
        kwargs["bad_words"] = words  # SamplingParams checks each
    bias = logit_bias(body)
    if bias:
        kwargs["logit_bias"] = bias
    constraint, structured_field = structured_outputs(body)
    if tool_calls is not None:  # the call tool_choice demands is generated under its schema
        if constraint is not None:
            raise bad(
                f"{structured_field} cannot go with a tool call that tool_choice demands",
                structured_field,
            )
        constraint, structured_field = tool_calls.constraint, "tools"
    kwargs["structured_outputs"] = constraint
    if kwargs.get("n", 1) > MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {kwargs['n']}", "n")
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
        field(body, "priority", "int", 0),
        include_usage and continuous,
        field(body, "return_tokens_as_token_ids", "bool", False),
    )


def as_field(message: str, field: str) -> str:
    """A message naming StructuredOutputsParams' fields ("structured_outputs.json is not
    JSON", from a worker too) as naming `field`, the body's field that asked (guided_json)."""
    if field == "structured_outputs":
        return message
    return re.sub(r"^structured_outputs(\.\w+)?", field, message)


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, as {id: bias}."""
    raw = field(body, "logit_bias", "dict", {})
    bias = {}
    for key, value in raw.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or len(key) > 19:  # 19 digits: 64 bits' reach
            raise bad(f"logit_bias keys must be token ids, got {key!r}"[:300], "logit_bias")
        if type(value) not in (int, float) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}"[:300],
                "logit_bias",
            )
        bias[int(key)] = float(value)
    return bias


@dataclass(slots=True)
class CompletionRequest:
    prompts: list[str | dict[str, Any]]  # each a string or {"prompt_token_ids": [...]}
    echo: bool
    common: Common


def parse_completion(
    body: dict[str, Any], defaults: dict[str, Any] | None = None
) -> CompletionRequest:
    """A completion body; `defaults`: see parse_common."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required (a string, a list of strings or of token ids)", "prompt")
    raw = body["prompt"]
    if isinstance(raw, list):
        raw = [[as_int(t) for t in p] if isinstance(p, list) else as_int(p) for p in raw]
    prompts: list[str | dict[str, Any]]
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw, list) and raw and all(type(t) is int for t in raw):
        prompts = [{"prompt_token_ids": raw}]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        prompts = list(raw)
    elif (
        isinstance(raw, list)
        and raw
        and all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in raw)
    ):
        prompts = [{"prompt_token_ids": p} for p in raw]
    else:
        raise bad(
            "prompt must be a string, a non-empty list of strings, or token id lists", "prompt"
        )
    if field(body, "suffix", "str"):
        raise bad("suffix is not supported", "suffix")
    for name, no_op in (("tools", []), ("tool_choice", "none")):
        if body.get(name) not in (None, no_op):
            raise bad(f"{name} is for chat completions", name)
    echo = field(body, "echo", "bool", False)
    logprobs = field(body, "logprobs", "int")
    max_tokens = field(body, "max_tokens", "int", 16)
    # echo with logprobs scores the prompt too: its tokens' logprobs come first.
    prompt_logprobs = logprobs if echo else None
    common = parse_common(
        body, max_tokens, logprobs, {}, prompt_logprobs=prompt_logprobs, defaults=defaults
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
    body: dict[str, Any],
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
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages is required: a non-empty list of {role, content} objects", "messages")
    want_logprobs = field(body, "logprobs", "bool", False)
    top = field(body, "top_logprobs", "int")
    if top is not None and not want_logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = field(body, "max_completion_tokens", "int")
    legacy_max_tokens = field(body, "max_tokens", "int")
    if legacy_max_tokens is not None and legacy_max_tokens < 1:  # checked even when unused
        raise bad(f"max_tokens must be in [1, inf], got {legacy_max_tokens}", "max_tokens")
    renames = {"logprobs": "top_logprobs"}
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    else:
        renames["max_tokens"] = "max_completion_tokens"
    template = parse_template_fields(body, template_names, trust_templates)
    echo = echoed_text(messages) if field(body, "echo", "bool", False) else ""
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
    parallel = body.get("parallel_tool_calls") is not False  # parse_tools checked it
    return ChatRequest(
        messages,
        common,
        want_logprobs,
        template,
        tools,
        tool_calls,
        echo,
        auto,
        parallel,
        reasoning_parser,
    )
