"""The request bodies' models: SamplingParams' field rules reach every body, its OpenAPI
schema and Ollama's options from that one statement, and a bad body is a 400 naming the field."""

from __future__ import annotations

import pytest

from loomllm.protocols.sampling import SamplingParams, field_specs
from loomllm.server.bodies.openai_bodies import ChatBody, CompletionBody
from loomllm.server.bodies.openapi_schemas import GENERATION_BODIES, request_schemas
from loomllm.server.bodies.sampling_fields import engine_fields
from loomllm.server.ollama.options import SAMPLING
from loomllm.server.openai.api_error import ApiError
from loomllm.server.openai.body_parsing import parse

IN_BODY = {name: args for name, args in field_specs().items() if args[3].in_body}
CHAT = {"messages": [{"role": "user", "content": "w5"}]}


def valid(scalar: type, is_list: bool, low: float | None, high: float | None) -> object:
    """A value the rule takes: its low bound (or 1, or true)."""
    value: object = True if scalar is bool else scalar(low if low is not None else 1)
    if high is not None and value > high:  # type: ignore[operator]
        value = scalar(high)
    return [value] if is_list else value


def test_the_field_rules_are_the_bodies_the_schema_s_and_ollama_s():
    assert {"n", "temperature", "top_p", "min_p", "seed", "allowed_token_ids"} <= set(IN_BODY)
    schemas = request_schemas(GENERATION_BODIES, "m", 64, 100)
    for name, (scalar, _, is_list, rule) in IN_BODY.items():
        for body in ("CompletionBody", "ChatBody"):
            prop = schemas[body]["properties"][name]
            item = prop["items"] if is_list else prop
            high = rule.high if rule.body_high is None else rule.body_high
            if rule.low is not None:
                key = "exclusiveMinimum" if rule.low_open else "minimum"
                assert item[key] == rule.low, (body, name)
            if high is not None:
                assert item["maximum"] == high, (body, name)
            if rule.token_ids:
                assert item["maximum"] == 99  # the vocabulary's last id
            assert prop.get("description") == (rule.doc or None)
        assert SAMPLING[name] == name  # Ollama's options take it by its name
        value = valid(scalar, is_list, rule.low if not rule.low_open else None, high)
        if rule.low_open:
            value = 0.5 if high is None or high >= 0.5 else high
        given = parse(ChatBody, {**CHAT, name: value})
        assert engine_fields(given)[name] == value
        params = SamplingParams(**engine_fields(given))
        assert getattr(params, name) == (tuple(value) if is_list else value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(n for n, a in IN_BODY.items() if a[3].low is not None))
def test_a_value_below_a_rule_is_a_400_naming_the_field(name):
    rule = IN_BODY[name][3]
    assert rule.low is not None
    low = rule.low if rule.low_open else rule.low - 1
    value = [int(low)] if IN_BODY[name][2] else low
    with pytest.raises(ApiError) as caught:
        parse(CompletionBody, {"prompt": "w5", name: value})
    assert caught.value.status == 400 and caught.value.param == name
    assert caught.value.message.startswith(name)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "w5", "n": "2"}, "n", "valid integer"),
        ({"prompt": "w5", "max_tokens": 2.5}, "max_tokens", "valid integer"),
        ({"prompt": "w5", "temperature": 10**400}, "temperature", "valid number"),
        ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "w5", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (
            {"prompt": "w5", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "",
        ),
        ({}, "prompt", "Field required"),
    ],
)
def test_completion_errors_name_the_field(body, param, words):
    with pytest.raises(ApiError) as caught:
        parse(CompletionBody, body)
    assert caught.value.param == param and words in caught.value.message


def test_chat_errors_name_the_field_and_its_path():
    cases = [
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages",
            "messages[0]",
        ),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({**CHAT, "continue_final_message": True}, "continue_final_message", "add_generation"),
        ({**CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
        (
            {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools",
            "tools[0]",
        ),
    ]
    for body, param, words in cases:
        with pytest.raises(ApiError) as caught:
            parse(ChatBody, body)
        assert caught.value.param == param and words in caught.value.message, caught.value.message
    # 2.0 is the integer 2, as JSON has one number type; fields the body does not know pass.
    given = parse(ChatBody, {**CHAT, "max_tokens": 2.0, "user": "x"})
    assert given.max_tokens == 2 and type(given.max_tokens) is int
