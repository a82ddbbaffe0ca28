"""The server's OpenAPI 3.1 document, built from its real limits; served at GET /openapi.json.

Request schemas state what schemas.py accepts, field by field: null means "absent" wherever
the server reads it so. What JSON Schema cannot state (a text prompt's token count,
min_tokens <= max_tokens) is in the descriptions; the server answers it with a 400.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

from protocols.sampling import MAX_LOGPROBS
from runtime.server.schemas import GUIDED_FIELDS, MAX_LOGIT_BIAS, MAX_N, UNSUPPORTED

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT_MAX = sys.float_info.max  # a bigger JSON number is no float: 400
# "abort": the server shut down mid-request; "tool_calls": tool_choice "required"
FINISH_REASONS = ["stop", "length", "abort", "tool_calls"]

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(low: int = INT64_MIN, high: int = INT64_MAX, **extra: Any) -> Schema:
    # Every integer crosses to the workers as msgpack: 64 bits at most.
    return {"type": ["integer", "null"], "minimum": low, "maximum": high, **extra}


def _number(**bounds: Any) -> Schema:
    return {"type": ["number", "null"], "minimum": -FLOAT_MAX, "maximum": FLOAT_MAX, **bounds}


def _bool(**extra: Any) -> Schema:
    return {"type": ["boolean", "null"], **extra}


def _object(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _sampling(vocab_size: int) -> dict[str, Schema]:
    """The fields completions and chat share (parse_common); vLLM's extras included."""
    stop_string = {"type": "string", "minLength": 1}
    unsupported = {name: {"enum": [*no_ops, None], "description": "unsupported: only a value "
                          "that asks for nothing"} for name, no_ops in UNSUPPORTED.items()}
    return {
        **unsupported,
        "temperature": _number(minimum=0),
        "top_p": _number(exclusiveMinimum=0, maximum=1),
        "n": _int(1, MAX_N, description="choices per prompt"),
        "seed": _int(description="each of the n choices samples with seed + its index, "
                                 "which must fit in 64 bits too"),
        "presence_penalty": _number(minimum=-2, maximum=2),
        "frequency_penalty": _number(minimum=-2, maximum=2),
        "repetition_penalty": _number(exclusiveMinimum=0),
        "top_k": _int(-1, description="0 or -1: no top-k"),
        "min_p": _number(minimum=0, maximum=1),
        "min_tokens": _int(0, description="at most max_tokens (else 400)"),
        "ignore_eos": _bool(),
        "skip_special_tokens": _bool(),
        "include_stop_str_in_output": _bool(),
        "stop": {"anyOf": [stop_string, {"type": "array", "items": stop_string},
                           {"type": "null"}]},  # fmt: skip
        "stop_token_ids": {"type": ["array", "null"],
                           "items": {"type": "integer", "minimum": 0,
                                     "maximum": vocab_size - 1}},
        "logit_bias": {
            "type": ["object", "null"], "propertyNames": {"pattern": _ids_below(vocab_size)},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                     "maximum": MAX_LOGIT_BIAS},
            "description": "{token id: added to its logit}; -100 all but bans it, 100 all but "
                           "forces it",
        },
        "allowed_token_ids": {"type": ["array", "null"], "minItems": 1,
                              "items": {"type": "integer", "minimum": 0,
                                        "maximum": vocab_size - 1},
                              "description": "only these can be sampled; with min_tokens, "
                                             "not only eos and stop_token_ids"},
        "response_format": {"anyOf": [
            _object({"type": {"enum": ["text", "json_object"]}}, ["type"]),
            _object({"type": {"const": "json_schema"},
                     "json_schema": _object({"name": {"type": "string"},
                                             "schema": {"type": "object"},
                                             "strict": {"type": ["boolean", "null"]}},
                                            ["schema"])}, ["type", "json_schema"]),
            {"type": "null"}]},
        "structured_outputs": {
            "anyOf": [_one_of_grammars(), {"type": "null"}],
            "description": "vLLM's: exactly one of json (a schema), json_object, regex, "
                           "choice, grammar (EBNF); one that does not compile: 400",
        },
        **{name: {"type": ["array", "null"], "minItems": 1,
                  "items": {"type": "string", "minLength": 1}} if key == "choice" else
           {"type": ["object", "string", "boolean", "null"]} if key == "json" else
           {"type": ["string", "null"], "minLength": 1}
           for name, key in GUIDED_FIELDS.items()},
        "stream": _bool(),
        "stream_options": {
            "type": ["object", "null"], "description": "only with stream: true",
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
        },
    }  # fmt: skip


def _tools() -> dict[str, Schema]:
    """Chat's tool fields (runtime/server/tool_calls.py): names unique, and tool_choice
    "auto" (the default with tools) is a 400, which a schema cannot say."""
    function = _object({
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": ["string", "null"]}, "parameters": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]},
    }, ["name"])  # fmt: skip
    tool = _object({"type": {"const": "function"}, "function": function}, ["type", "function"])
    named = _object({"type": {"const": "function"},
                     "function": _object({"name": {"type": "string"}}, ["name"])},
                    ["type", "function"])  # fmt: skip
    return {
        "tools": {"type": ["array", "null"], "items": tool, "maxItems": 128},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, named],
                        "description": '"required" or a named function: the answer is '
                                       'tool_calls, generated under the tools\' schemas; '
                                       '"auto": 400'},
        "parallel_tool_calls": _bool(),
    }


def _one_of_grammars() -> Schema:
    text = {"type": "string", "minLength": 1}
    options = {"json": {"type": ["object", "string", "boolean"]}, "json_object": {"const": True},
               "regex": text, "choice": {"type": "array", "minItems": 1, "items": text},
               "grammar": text}
    return {"oneOf": [{"type": "object", "properties": {key: value},
                       "required": [key], "additionalProperties": False}
                      for key, value in options.items()]}  # fmt: skip


def _ids_below(n: int) -> str:
    """A regular expression for the decimal numbers 0 to n - 1 (no leading zeros)."""
    top = str(n - 1)
    options = ["0"] if n > 1 else []
    if len(top) > 1:  # every shorter number
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # as long as top: its first i digits, then a smaller one
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
    "if": {"properties": {"stream_options": {"type": "object", "minProperties": 1}},
           "required": ["stream_options"]},
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
}  # fmt: skip


def _requests(model: str, max_model_len: int, vocab_size: int) -> dict[str, Schema]:
    model_field = {"type": ["string", "null"], "enum": [model, None],
                   "description": "another name: 404"}  # fmt: skip
    tokens = {"type": "array", "minItems": 1, "maxItems": max_model_len - 1,
              "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}  # fmt: skip
    text = {"type": "string", "description": f"1 to {max_model_len - 1} tokens once encoded"}
    completion = _object({
        "model": model_field,
        "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}, tokens,
                             {"type": "array", "items": tokens, "minItems": 1}]},
        "max_tokens": _int(1, description="default 16; output stops at max_model_len"),
        "echo": _bool(),
        "logprobs": _int(0, MAX_LOGPROBS),
        "suffix": {"type": ["string", "null"], "maxLength": 0, "description": "unsupported"},
        "tools": {"type": ["array", "null"], "maxItems": 0, "description": "chat only"},
        "tool_choice": {"enum": ["none", None], "description": "chat only"},
        **_sampling(vocab_size),
    }, ["prompt"])  # fmt: skip
    completion["allOf"] = [_STREAM_OPTIONS_RULE]
    text_part = _object({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
    message = _object({
        "role": {"type": "string", "minLength": 1},
        "content": {"type": ["string", "array", "null"], "items": text_part},
        "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}},
    }, ["role"])  # fmt: skip
    # content may be null or absent only in a message with tool_calls
    message["anyOf"] = [
        {"properties": {"content": {"type": ["string", "array"]}}, "required": ["content"]},
        {"properties": {"tool_calls": {"not": {"type": "null"}}}, "required": ["tool_calls"]},
    ]
    chat = _object({
        "model": model_field,
        "messages": {"type": "array", "items": message, "minItems": 1,
                     "description": f"rendered by the chat template: 1 to {max_model_len - 1} "
                                    "tokens"},
        "max_completion_tokens": _int(1, description="default: up to max_model_len"),
        "max_tokens": _int(1, description="used when max_completion_tokens is absent"),
        "logprobs": _bool(),
        "top_logprobs": _int(0, MAX_LOGPROBS, description="only with logprobs: true"),
        **_tools(),
        **_sampling(vocab_size),
    }, ["messages"])  # fmt: skip
    chat["allOf"] = [_STREAM_OPTIONS_RULE, {
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    }]  # fmt: skip
    tokenize = _object({
        "model": model_field, "prompt": {"type": ["string", "null"]},
        "messages": {"type": ["array", "null"], "items": message, "minItems": 1},
        "add_special_tokens": _bool(description="for prompt; messages never add them"),
    })  # fmt: skip
    tokenize["anyOf"] = [
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
        {"properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
         "required": ["prompt"]},
    ]  # fmt: skip
    detokenize = _object({"model": model_field, "tokens": {"type": "array",
                                                           "items": tokens["items"]}}, ["tokens"])
    return {"CompletionRequest": completion, "ChatCompletionRequest": chat,
            "TokenizeRequest": tokenize, "DetokenizeRequest": detokenize}  # fmt: skip


def _responses(model: str) -> dict[str, Schema]:
    def envelope(kind: str, choice: Schema, chunk: bool) -> Schema:
        props = {"id": {"type": "string"}, "object": {"const": kind},
                 "created": {"type": "integer"}, "model": {"const": model},
                 "choices": {"type": "array", "items": choice}, "usage": _ref("Usage")}  # fmt: skip
        # A chunk has usage only when it is the last one, with stream_options.include_usage.
        return _object(props, [name for name in props if not (chunk and name == "usage")])

    count = {"type": "integer", "minimum": 0}
    finish = {"enum": FINISH_REASONS}
    maybe_finish = {"enum": [*FINISH_REASONS, None]}
    text_logprobs = {"anyOf": [{"type": "null"}, _object({
        "tokens": {"type": "array", "items": {"type": "string"}},
        # null for an echoed prompt's first token (nothing predicts it)
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {"type": "array", "items": {
            "type": ["object", "null"], "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": count},
    }, ["tokens", "token_logprobs", "top_logprobs", "text_offset"])]}  # fmt: skip
    top = {"token": {"type": "string"}, "logprob": {"type": "number"},
           "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}
    entry = _object({**top, "top_logprobs": {"type": "array", "items": _object(top, list(top))}},
                    [*top, "top_logprobs"])  # fmt: skip
    chat_logprobs = {"anyOf": [{"type": "null"}, _object(
        {"content": {"type": "array", "items": entry}}, ["content"])]}  # fmt: skip

    def choice(body: dict[str, Schema], logprobs: Schema, reason: Schema) -> Schema:
        props = {"index": count, **body, "logprobs": logprobs, "finish_reason": reason}
        return _object(props, list(props))

    text = {"text": {"type": "string"}}
    call = _object({"id": {"type": "string"}, "type": {"const": "function"},
                    "function": _object({"name": {"type": "string"},
                                         "arguments": {"type": "string"}},
                                        ["name", "arguments"])},
                   ["id", "type", "function"])  # fmt: skip
    message = {"message": _object({"role": {"const": "assistant"},
                                   "content": {"type": ["string", "null"]},
                                   "tool_calls": {"type": "array", "items": call}},
                                  ["role", "content"])}  # fmt: skip
    call_delta = _object({"index": count, "id": {"type": "string"},
                          "type": {"const": "function"},
                          "function": _object({"name": {"type": "string"},
                                               "arguments": {"type": "string"}})},
                         ["index"])  # fmt: skip
    delta = {"delta": _object({"role": {"const": "assistant"},
                               "content": {"type": ["string", "null"]},
                               "tool_calls": {"type": "array", "items": call_delta}})}
    return {
        "Usage": _object({"prompt_tokens": count, "completion_tokens": count,
                          "total_tokens": count}, ["prompt_tokens", "completion_tokens",
                                                   "total_tokens"]),
        "Completion": envelope("text_completion", choice(text, text_logprobs, finish), False),
        "CompletionChunk": envelope("text_completion",
                                    choice(text, text_logprobs, maybe_finish), True),
        "ChatCompletion": envelope("chat.completion", choice(message, chat_logprobs, finish),
                                   False),
        "ChatCompletionChunk": envelope("chat.completion.chunk",
                                        choice(delta, chat_logprobs, maybe_finish), True),
        "Error": _object({"error": _object({
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]},
        }, ["message", "type", "param", "code"])}, ["error"]),
    }  # fmt: skip


def _event_stream(chunk: str) -> Schema:
    """SSE: each event's data is a chunk (or an error, then the stream ends) or [DONE]."""
    data = {"anyOf": [{"const": "[DONE]"}, {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]},
    }]}  # fmt: skip
    return {"schema": _object({"data": data}, ["data"])}


ERRORS = {
    "400": "invalid request: the message names the field (param)",
    "401": "missing or wrong API key",
    "404": "no such model",
    "413": "request body too large",
    "415": "Content-Type other than application/json",
    "500": "the engine failed this request",
    "503": "the engine is restarting or the server is shutting down",
}


def _operation(
    summary: str, request: str | None, ok: Schema, statuses: list[str], example: Any = None
) -> Schema:
    error = {"content": {"application/json": {"schema": _ref("Error")}}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    responses |= {s: {"description": ERRORS[s], **error} for s in statuses}
    operation: Schema = {"summary": summary, "responses": responses}
    if request is not None:
        media = {"schema": _ref(request), "example": example}
        operation["requestBody"] = {"required": True, "content": {"application/json": media}}
    return operation


def build_openapi(
    model: str, max_model_len: int, vocab_size: int, *, needs_api_key: bool = False,
    open_paths: Collection[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The OpenAPI 3.1 document of build_app()'s routes, for this model and these limits.

    With `needs_api_key`, the routes outside `open_paths` require a Bearer token (else 401).
    """
    body_errors = ["400", "404", "413", "415", "500", "503"] + (["401"] if needs_api_key else [])
    get_errors = ["401"] if needs_api_key else []  # /v1/models; /health and /version: open

    def json_(schema: Schema) -> Schema:
        return {"application/json": {"schema": schema}}

    card = _object({"id": {"const": model}, "object": {"const": "model"},
                    "created": {"type": "integer"}, "owned_by": {"type": "string"},
                    "root": {"type": "string"}, "max_model_len": {"const": max_model_len}},
                   ["id", "object", "created", "owned_by", "root", "max_model_len"])  # fmt: skip
    models = _object({"object": {"const": "list"}, "data": {"type": "array", "items": card}},
                     ["object", "data"])  # fmt: skip
    text = "Say this is a test"
    examples = {"completion": {"model": model, "prompt": text, "max_tokens": 7, "temperature": 0},
                "chat": {"model": model, "messages": [{"role": "user", "content": text}]}}
    status = _object({"status": {"enum": ["ok", "unhealthy"]}, "error": {"type": "string"}},
                     ["status"])
    paths = {
        "/v1/models": {"get": _operation("the served model", None, json_(models), get_errors)},
        "/v1/completions": {"post": _operation(
            "text completion", "CompletionRequest",
            json_(_ref("Completion")) | {"text/event-stream": _event_stream("CompletionChunk")},
            body_errors, examples["completion"])},
        "/v1/chat/completions": {"post": _operation(
            "chat completion", "ChatCompletionRequest",
            json_(_ref("ChatCompletion"))
            | {"text/event-stream": _event_stream("ChatCompletionChunk")}, body_errors,
            examples["chat"])},
        "/tokenize": {"post": _operation("text or messages to token ids", "TokenizeRequest", json_(
            _object({"count": {"type": "integer"}, "max_model_len": {"const": max_model_len},
                     "tokens": {"type": "array", "items": {"type": "integer"}}},
                    ["count", "max_model_len", "tokens"])), body_errors,
            {"model": model, "prompt": text})},
        "/detokenize": {"post": _operation(
            "token ids to text", "DetokenizeRequest",
            json_(_object({"prompt": {"type": "string"}}, ["prompt"])), body_errors,
            {"model": model, "tokens": [0]})},
        "/health": {"get": _operation("one 1-token generation", None, json_(status), [])},
        "/version": {"get": _operation("the loomllm version", None, json_(
            _object({"version": {"type": "string"}}, ["version"])), [])},
    }  # fmt: skip
    paths["/health"]["get"]["responses"]["503"] = {"description": "unhealthy",
                                                  "content": json_(status)}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "loomllm OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {"schemas": _requests(model, max_model_len, vocab_size)
                       | _responses(model)},  # fmt: skip
    }
    if needs_api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path not in open_paths:
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return doc
