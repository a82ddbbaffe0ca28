"""The request bodies' JSON schemas for the OpenAPI document (openapi.py).

They state what schemas.py accepts, field by field; null means "absent" wherever the server does.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

from loomllm.protocols.sampling import MAX_LOGPROBS
from loomllm.server.openai.chat_template_fields import RESERVED_VARIABLES
from loomllm.server.openai.schemas import (
    GUIDED_FIELDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    UNSUPPORTED,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT_MAX = sys.float_info.max  # a bigger JSON number is no float: 400

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(low: int = INT64_MIN, high: int = INT64_MAX, **extra: Any) -> Schema:
    # Every integer crosses to the workers as msgpack: 64 bits at most.
    return {"type": ["integer", "null"], "minimum": low, "maximum": high, **extra}


def _number(**bounds: Any) -> Schema:
    return {"type": ["number", "null"], "minimum": -FLOAT_MAX, "maximum": FLOAT_MAX, **bounds}


def _bool(**extra: Any) -> Schema:
    return {"type": ["boolean", "null"], **extra}


def object_of(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _sampling(vocab_size: int, priority: bool, max_model_len: int) -> dict[str, Schema]:
    """The fields completions and chat share (parse_common); vLLM's extras included."""
    stop_string = {"type": "string", "minLength": 1}
    unsupported = {
        name: {
            "enum": [*no_ops, None],
            "description": "unsupported: only a value that asks for nothing",
        }
        for name, no_ops in UNSUPPORTED.items()
    }
    return {
        **unsupported,
        "temperature": _number(minimum=0),
        "top_p": _number(exclusiveMinimum=0, maximum=1),
        "n": _int(1, MAX_N, description="choices per prompt"),
        "return_tokens_as_token_ids": _bool(description="logprobs' tokens as token_id:<id>"),
        "truncate_prompt_tokens": {
            "anyOf": [_int(1, max_model_len - 1), {"const": -1}],
            "description": "keep the prompt's last k tokens; -1: max_model_len - 1",
        },
        "bad_words": {
            "type": ["array", "null"],
            "maxItems": MAX_BAD_WORDS,
            "items": {"type": "string", "pattern": "\\S", "maxLength": MAX_BAD_WORD_CHARS},
        },
        "priority": _int(description="lower runs first")
        if priority
        else {"enum": [0, None], "description": "only with --scheduling-policy priority"},
        "seed": _int(
            description="each of the n choices samples with seed + its index, "
            "which must fit in 64 bits too"
        ),
        "presence_penalty": _number(minimum=-2, maximum=2),
        "frequency_penalty": _number(minimum=-2, maximum=2),
        "repetition_penalty": _number(exclusiveMinimum=0),
        "top_k": _int(-1, description="0 or -1: no top-k"),
        "min_p": _number(minimum=0, maximum=1),
        "min_tokens": _int(0, description="at most max_tokens (else 400)"),
        "ignore_eos": _bool(),
        "skip_special_tokens": _bool(),
        "include_stop_str_in_output": _bool(),
        "stop": {"anyOf": [stop_string, {"type": "array", "items": stop_string}, {"type": "null"}]},
        "stop_token_ids": {
            "type": ["array", "null"],
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
        },
        "logit_bias": {
            "type": ["object", "null"],
            "propertyNames": {"pattern": _ids_below(vocab_size)},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
            "description": "{token id: added to its logit}; -100 all but bans it, 100 all but "
            "forces it",
        },
        "allowed_token_ids": {
            "type": ["array", "null"],
            "minItems": 1,
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            "description": "only these can be sampled; with min_tokens, "
            "not only eos and stop_token_ids",
        },
        "response_format": {
            "anyOf": [
                object_of({"type": {"enum": ["text", "json_object"]}}, ["type"]),
                object_of(
                    {
                        "type": {"const": "json_schema"},
                        "json_schema": object_of(
                            {
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": {"type": ["boolean", "null"]},
                            },
                            ["schema"],
                        ),
                    },
                    ["type", "json_schema"],
                ),
                {"type": "null"},
            ]
        },
        "structured_outputs": {
            "anyOf": [_one_of_grammars(), {"type": "null"}],
            "description": "vLLM's: exactly one of json (a schema), json_object, regex, "
            "choice, grammar (EBNF); one that does not compile: 400",
        },
        **{
            name: {
                "type": ["array", "null"],
                "minItems": 1,
                "items": {"type": "string", "minLength": 1},
            }
            if key == "choice"
            else {"type": ["object", "string", "boolean", "null"]}
            if key == "json"
            else {"type": ["string", "null"], "minLength": 1}
            for name, key in GUIDED_FIELDS.items()
        },
        "stream": _bool(),
        "stream_options": {
            "type": ["object", "null"],
            "description": "only with stream: true",
            "properties": {
                "include_usage": {"type": ["boolean", "null"]},
                "continuous_usage_stats": {"type": ["boolean", "null"]},
            },
        },
    }


def _tools(auto: bool) -> dict[str, Schema]:
    """Chat's tool fields (runtime/server/openai/tool_calls.py): names unique, and (without `auto`)
    tool_choice "auto", the default with tools, is a 400, which a schema cannot say."""
    function = object_of(
        {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]},
        },
        ["name"],
    )
    tool = object_of({"type": {"const": "function"}, "function": function}, ["type", "function"])
    named = object_of(
        {
            "type": {"const": "function"},
            "function": object_of({"name": {"type": "string"}}, ["name"]),
        },
        ["type", "function"],
    )
    return {
        "tools": {"type": ["array", "null"], "items": tool, "maxItems": 128},
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required", None]}, named],
            "description": '"required" or a named function: the answer is '
            "tool_calls, generated under the tools' schemas; "
            + (
                '"auto": calls read out of the answer'
                if auto
                else '"auto": 400 (no --enable-auto-tool-choice)'
            ),
        },
        "parallel_tool_calls": _bool(),
    }


def _one_of_grammars() -> Schema:
    text = {"type": "string", "minLength": 1}
    options = {
        "json": {"type": ["object", "string", "boolean"]},
        "json_object": {"const": True},
        "regex": text,
        "choice": {"type": "array", "minItems": 1, "items": text},
        "grammar": text,
    }
    return {
        "oneOf": [
            {
                "type": "object",
                "properties": {key: value},
                "required": [key],
                "additionalProperties": False,
            }
            for key, value in options.items()
        ]
    }


def _ids_below(n: int) -> str:
    """A regular expression for the decimal numbers 0 to n - 1 (no leading zeros)."""
    top = str(n - 1)
    options = ["0"] if n > 1 else []
    if len(top) > 1:  # every number with fewer digits than top
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    # Numbers as long as top: top's first i digits, then a smaller digit, then any digits.
    for i, digit in enumerate(top):
        low = "1" if i == 0 else "0"
        if digit > low:
            rest = len(top) - i - 1
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" * (rest > 0)))
    options.append(top)
    # Not "$": in Python's dialect (and tools written in it) "$" also matches before a final
    # newline, which JSON Schema's ECMA-262 does not; this end means the same in both.
    return "^(" + "|".join(dict.fromkeys(options)) + r")(?![\s\S])"


# A non-empty stream_options needs stream: true.
_STREAM_OPTIONS_RULE = {
    "if": {
        "properties": {"stream_options": {"type": "object", "minProperties": 1}},
        "required": ["stream_options"],
    },
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
}


def _template_fields(template_names: Collection[str], trust_templates: bool) -> dict[str, Schema]:
    """The chat-template fields (runtime/server/openai/chat_template_fields.py)."""
    if trust_templates:
        template = {
            "type": ["string", "null"],
            "minLength": 1,
            "description": "a template's name, or a template's text",
        }
    else:
        template = {
            "enum": [*sorted(template_names), None],
            "description": "one of the "
            "model's templates; a template's text needs --trust-request-chat-template",
        }
    return {
        "add_generation_prompt": _bool(description="default true"),
        "continue_final_message": _bool(
            description="go on with the final message's text (with add_generation_prompt: false)"
        ),
        "chat_template": template,
        "chat_template_kwargs": {
            "type": ["object", "null"],
            "description": "the chat template's variables",
            "propertyNames": {"not": {"enum": sorted(RESERVED_VARIABLES)}},
        },
        "documents": {"type": ["array", "null"], "items": {"type": "object"}},
    }


# continue_final_message needs add_generation_prompt: false, which defaults to true.
_CONTINUE_RULE = {
    "if": {
        "properties": {"continue_final_message": {"const": True}},
        "required": ["continue_final_message"],
    },
    "then": {
        "properties": {"add_generation_prompt": {"const": False}},
        "required": ["add_generation_prompt"],
    },
}


def request_schemas(
    model: str,
    max_model_len: int,
    vocab_size: int,
    template_names: Collection[str] = (),
    trust_templates: bool = False,
    auto_tools: bool = False,
    priority: bool = False,
) -> dict[str, Schema]:
    """Each request body's schema, by component name.

    What JSON Schema cannot state (a text prompt's token count, min_tokens <= max_tokens) is
    in the descriptions; the server answers it with a 400.
    """
    model_field = {
        "type": ["string", "null"],
        "enum": [model, None],
        "description": "another name: 404",
    }
    any_tokens = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    tokens = {**any_tokens, "maxItems": max_model_len - 1}
    text = {
        "type": "string",
        "description": f"1 to {max_model_len - 1} tokens once encoded "
        "(or truncated: truncate_prompt_tokens)",
    }

    def prompts(ids: Schema) -> Schema:
        return {
            "anyOf": [
                text,
                {"type": "array", "items": text, "minItems": 1},
                ids,
                {"type": "array", "items": ids, "minItems": 1},
            ]
        }

    completion = object_of(
        {
            "model": model_field,
            "prompt": prompts(any_tokens),
            "max_tokens": _int(1, description="default 16; output stops at max_model_len"),
            "echo": _bool(),
            "logprobs": _int(0, MAX_LOGPROBS),
            "suffix": {"type": ["string", "null"], "maxLength": 0, "description": "unsupported"},
            "tools": {"type": ["array", "null"], "maxItems": 0, "description": "chat only"},
            "tool_choice": {"enum": ["none", None], "description": "chat only"},
            **_sampling(vocab_size, priority, max_model_len),
        },
        ["prompt"],
    )
    # Token ids past max_model_len - 1 only when truncate_prompt_tokens cuts them.
    truncating = {
        "properties": {"truncate_prompt_tokens": {"type": "integer"}},
        "required": ["truncate_prompt_tokens"],
    }
    completion["allOf"] = [
        _STREAM_OPTIONS_RULE,
        {"if": truncating, "else": {"properties": {"prompt": prompts(tokens)}}},
    ]
    text_part = object_of({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
    message = object_of(
        {
            "role": {"type": "string", "minLength": 1},
            "content": {"type": ["string", "array", "null"], "items": text_part},
            "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}},
        },
        ["role"],
    )
    # content may be null or absent only in a message with tool_calls
    message["anyOf"] = [
        {"properties": {"content": {"type": ["string", "array"]}}, "required": ["content"]},
        {"properties": {"tool_calls": {"not": {"type": "null"}}}, "required": ["tool_calls"]},
    ]
    chat = object_of(
        {
            "model": model_field,
            "messages": {
                "type": "array",
                "items": message,
                "minItems": 1,
                "description": f"rendered by the chat template: 1 to {max_model_len - 1} tokens",
            },
            "max_completion_tokens": _int(1, description="default: up to max_model_len"),
            "max_tokens": _int(1, description="used when max_completion_tokens is absent"),
            "logprobs": _bool(),
            "top_logprobs": _int(0, MAX_LOGPROBS, description="only with logprobs: true"),
            "echo": _bool(
                description="the answer starts with the final message's text when "
                "that is the assistant's"
            ),
            **_template_fields(template_names, trust_templates),
            **_tools(auto_tools),
            **_sampling(vocab_size, priority, max_model_len),
        },
        ["messages"],
    )
    chat["allOf"] = [
        _STREAM_OPTIONS_RULE,
        _CONTINUE_RULE,
        {
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        },
    ]
    tokenize = object_of(
        {
            "model": model_field,
            "prompt": {"type": ["string", "null"]},
            "messages": {"type": ["array", "null"], "items": message, "minItems": 1},
            "add_special_tokens": _bool(description="for prompt; messages never add them"),
            **_template_fields(template_names, trust_templates),
        }
    )
    tokenize["allOf"] = [_CONTINUE_RULE]
    tokenize["anyOf"] = [
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
        {
            "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
            "required": ["prompt"],
        },
    ]
    detokenize = object_of(
        {"model": model_field, "tokens": {"type": "array", "items": tokens["items"]}}, ["tokens"]
    )
    return {
        "CompletionRequest": completion,
        "ChatCompletionRequest": chat,
        "TokenizeRequest": tokenize,
        "DetokenizeRequest": detokenize,
    }
