"""Tool calls and JSON schemas through the server, on a tiny model whose tokens are characters
(it can spell JSON): demanded calls come back as tool_calls whose arguments fit the
function's schema, streamed or not; "auto" and malformed tools are 400s. asyncio and trio.
"""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.servers import assert_error, sse_events
from support.tools import TOOLS, WEATHER

pytestmark = pytest.mark.anyio

ASK = {
    "messages": [{"role": "user", "content": "Weather?"}],
    "tools": TOOLS,
    "max_tokens": 96,
    "temperature": 1.0,
    "seed": 3,
    "n": 3,
}


def assert_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"unit", "rain"} and value["unit"] in ("c", "f")
    assert type(value["rain"]) is bool


async def test_a_named_function_is_called_with_arguments_that_fit_its_schema(char_server):
    _, client = char_server
    body = {**ASK, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert len(answer["choices"]) == 3
    parsed = ChatCompletion.model_validate(answer)  # as the openai SDK reads it
    assert parsed.choices[0].message.tool_calls[0].function.name == "weather"
    for choice in answer["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "stop" and message["content"] is None, choice
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "weather"
        assert_weather(call["function"]["arguments"])
    # Streamed: the call's name first, then its arguments as they come.
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "n": 1, "stream": True}
    ) as response:
        events = await sse_events(response)
    for event in events[:-1]:
        ChatCompletionChunk.model_validate(event)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "weather", "arguments": ""} and first["index"] == 0
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:])
    assert_weather(arguments)
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_required_calls_any_of_the_tools(char_server, stream):
    _, client = char_server
    body = {**ASK, "tool_choice": "required", "parallel_tool_calls": False, "stream": stream}
    if stream:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            events = await sse_events(response)
        # Whole calls, in the chunk that ends each choice.
        ends = [e["choices"][0] for e in events[:-1] if e["choices"][0]["finish_reason"]]
        calls = [(end["finish_reason"], end["delta"]["tool_calls"]) for end in ends]
    else:
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        calls = [(c["finish_reason"], c["message"]["tool_calls"]) for c in answer["choices"]]
    assert len(calls) == 3
    for finish, (call,) in calls:  # parallel_tool_calls false: one call each
        assert finish == "tool_calls" and call["function"]["name"] in ("weather", "ping")
        arguments = call["function"]["arguments"]
        if call["function"]["name"] == "weather":
            assert_weather(arguments)
        else:
            assert json.loads(arguments) == {}


async def test_references_in_a_tools_schema_hold_among_many_and_cut_calls_stay_calls(char_server):
    """A pydantic-style schema ($defs, "$ref") under "required", where each tool's schema
    sits inside the array of calls; a named call cut by max_tokens is still a tool call."""
    _, client = char_server
    unit = {
        "type": "object",
        "$defs": {"Unit": {"enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
    }
    tools = [{"type": "function", "function": {"name": "unit", "parameters": unit}}, TOOLS[1]]
    body = {**ASK, "tools": tools, "tool_choice": "required", "logprobs": True, "n": 2}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    for choice in answer["choices"]:
        (call,) = choice["message"]["tool_calls"][:1]
        if call["function"]["name"] == "unit":
            assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
    # Streamed, the held calls' logprobs come whole with them.
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "n": 1, "stream": True}
    ) as response:
        events = await sse_events(response)
    end = next(e["choices"][0] for e in events[:-1] if e["choices"][0]["finish_reason"])
    usage_free = [e for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert usage_free == [e for e in events[:-1] if e["choices"][0] is end]
    assert len(end["logprobs"]["content"]) > 3
    named = {
        **ASK,
        "n": 1,
        "max_tokens": 5,
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
    }
    cut = (await client.post("/v1/chat/completions", json=named)).json()["choices"][0]
    assert cut["finish_reason"] == "length"
    assert cut["message"]["tool_calls"][0]["function"]["arguments"].startswith('{"')


def test_an_answer_nested_past_jsons_depth_is_no_call():
    from loomllm.server.openai.tool_calls import ToolCalls

    required = ToolCalls(None, None)  # type: ignore[arg-type]
    assert required.calls("[" * 5000) is None and required.calls('[{"name": "f"}]') is None
    (call,) = ToolCalls("f", None).calls("[" * 5000)  # type: ignore[arg-type, misc]
    assert call["function"] == {"name": "f", "arguments": "[" * 5000}


async def test_a_json_schema_answer_parses(char_server):
    _, client = char_server
    body = {
        "messages": [{"role": "user", "content": "?"}],
        "max_tokens": 64,
        "n": 3,
        "seed": 1,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER},
        },
    }
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "stop"
        assert_weather(choice["message"]["content"])


async def test_tools_that_cannot_be_served_are_400s_and_the_engine_goes_on(char_server):
    engine, client = char_server
    named = {"type": "function", "function": {"name": "weather"}}
    cases = [
        ({**ASK}, "tool_choice"),  # "auto", the default with tools: no parser here
        ({**ASK, "tool_choice": "auto"}, "tool_choice"),
        ({**ASK, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({**ASK, "tools": [], "tool_choice": "required"}, "tool_choice"),
        (
            {
                **ASK,
                "tools": [{"type": "function", "function": {"name": "a b"}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({**ASK, "tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
        ({**ASK, "tools": [{"type": "code"}], "tool_choice": "required"}, "tools"),
        (
            {
                **ASK,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({**ASK, "tool_choice": named, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                **ASK,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),  # a call's arguments are an object
        (
            {
                **ASK,
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {**ASK, "tool_choice": named, "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ]
    for body, param in cases:
        assert_error(await client.post("/v1/chat/completions", json=body), 400, param)
    completion = {"prompt": "a", "max_tokens": 2, "tools": TOOLS}
    assert_error(await client.post("/v1/completions", json=completion), 400, "tools")
    # "none": the tools reach the template, the answer is text.
    body = {**ASK, "tool_choice": "none", "n": 1, "max_tokens": 4}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    await engine.wait_until_idle()
    assert engine.stats().num_running == 0
