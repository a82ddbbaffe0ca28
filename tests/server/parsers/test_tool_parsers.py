"""tool_choice "auto" with the hermes parser: whole answers split into content and calls, the
same split streamed however the text is cut into deltas, and through the server on a tiny
model whose tokens are characters (its answer forced by a one-choice grammar, so the parser
reads what the model really generated). asyncio and trio.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.servers import assert_error, running, sse_events
from support.tools import TOOLS, WEATHER_CALL, calls_of, streamed

from loomllm.server.parsers.tool_parsers import AutoToolDeltas, split_answer

PING_CALL = '<tool_call>\n{"name": "ping", "arguments": "{}"}\n</tool_call>'
# (answer, content, [(name, arguments)])
CASES = [
    ("It is sunny.", "It is sunny.", []),
    ("Trailing blanks stay  \n", "Trailing blanks stay  \n", []),
    ("a < b and <tool is not a tag", "a < b and <tool is not a tag", []),
    (WEATHER_CALL, None, [("weather", {"unit": "c", "rain": True})]),
    (
        "Let me look.\n\n" + WEATHER_CALL + "\n" + PING_CALL,
        "Let me look.",
        [("weather", {"unit": "c", "rain": True}), ("ping", {})],
    ),
    # cut short (max_tokens) after the JSON: the unclosed call still counts
    ('<tool_call>{"name": "ping", "arguments": {}}', None, [("ping", {})]),
    (
        "ok " + WEATHER_CALL + " and text after a call is dropped",
        "ok",
        [("weather", {"unit": "c", "rain": True})],
    ),
    # a block that is no call is text, its blanks before it kept; after a call, dropped
    ('Let me check. <tool_call>{"nam', 'Let me check. <tool_call>{"nam', []),
    (
        WEATHER_CALL + '\n<tool_call>{"name": "ping", "arg',
        None,
        [("weather", {"unit": "c", "rain": True})],
    ),
    ("<tool_call>[1]</tool_call>\n" + PING_CALL, "<tool_call>[1]</tool_call>", [("ping", {})]),
    ("Use <tool_call> tags, then JSON.", "Use <tool_call> tags, then JSON.", []),
    (
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud83d"}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud83d"}}</tool_call>',
        [],
    ),
]
NOT_CALLS = [
    '<tool_call>{"name": "weather", "argu',
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
]


@pytest.mark.parametrize("answer, content, calls", CASES)
def test_whole_answers_split_into_content_and_calls(answer, content, calls):
    got_content, got_calls = split_answer(answer)
    assert got_content == content and calls_of(got_calls) == calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    answer = WEATHER_CALL + PING_CALL
    assert calls_of(split_answer(answer, parallel=False)[1]) == [
        ("weather", {"unit": "c", "rain": True})
    ]
    deltas = AutoToolDeltas(parallel=False)
    first, _ = deltas.next(0, answer[:-5], None)
    last, reason = deltas.next(0, answer[-5:], "stop")
    assert [c["index"] for c in first["tool_calls"]] == [0] and last == {}
    assert reason == "tool_calls"


@pytest.mark.parametrize("answer", NOT_CALLS)
def test_what_does_not_parse_stays_text(answer):
    assert split_answer(answer) == (answer, [])
    content, calls = streamed(answer, [len(answer)])
    assert content == answer and calls == []


@pytest.mark.parametrize("answer, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_whole_answer_however_cut(answer, content, calls):
    rng = random.Random(0)
    cuttings = [list(range(1, len(answer) + 1)), [len(answer)]]  # char by char, whole
    cuttings += [
        sorted({*rng.sample(range(1, len(answer)), min(5, len(answer) - 1)), len(answer)})
        for _ in range(20)
    ]
    for cuts in cuttings:
        got_content, got_calls = streamed(answer, cuts)
        assert got_content == content and calls_of(got_calls, streamed=True) == calls, cuts


def test_held_text_is_sent_once_it_cannot_be_a_tag_or_a_call():
    deltas = AutoToolDeltas()
    assert deltas.next(0, "Hi <tool", None) == ({"content": "Hi"}, None)
    assert deltas.next(0, "s>", None) == ({"content": " <tools>"}, None)
    assert deltas.next(0, " <tool_call>  ", None) == (None, None)
    assert deltas.next(0, "is a tag", None) == ({"content": " <tool_call>  is a tag"}, None)
    delta, reason = deltas.next(0, "", "length")
    assert delta == {} and reason == "length"


FORCED = {
    "messages": [{"role": "user", "content": "Weather?"}],
    "tools": TOOLS,
    "max_tokens": 200,
    "temperature": 0,
}


@pytest.mark.anyio
async def test_auto_reads_the_calls_the_model_made(char_model, shared_manager):
    answer = "Checking.\n" + WEATHER_CALL
    body = {**FORCED, "structured_outputs": {"choice": [answer]}}  # the model spells it
    async with running(char_model, shared_manager, tool_call_parser="hermes") as (_, client):
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        ChatCompletion.model_validate(whole)  # as the openai SDK reads it
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking."
        assert calls_of(choice["message"]["tool_calls"]) == [
            ("weather", {"unit": "c", "rain": True})
        ]
        async with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            events = await sse_events(response)
        for event in events[:-1]:
            ChatCompletionChunk.model_validate(event)
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls_of(streamed_calls, streamed=True) == calls_of(choice["message"]["tool_calls"])
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        # A text answer stays text; "none" renders the tools and reads nothing.
        text = {**FORCED, "structured_outputs": {"choice": ["No tools needed."]}}
        plain = (await client.post("/v1/chat/completions", json=text)).json()["choices"][0]
        assert plain["message"] == {"role": "assistant", "content": "No tools needed."}
        assert plain["finish_reason"] == "stop"
        none = {**body, "tool_choice": "none"}
        kept = (await client.post("/v1/chat/completions", json=none)).json()["choices"][0]
        assert kept["message"]["content"] == answer and "tool_calls" not in kept["message"]
        # A prefilled answer that opens the call (continue_final_message), echoed: the
        # echo is read for calls too, whole and streamed.
        opened = '<tool_call>\n{"name": "weather", '
        rest = '"arguments": {"unit": "c", "rain": true}}\n</tool_call>'
        prefilled = {
            **FORCED,
            "messages": [*FORCED["messages"], {"role": "assistant", "content": opened}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
            "structured_outputs": {"choice": [rest]},
        }
        whole, chunks = await both_ways(client, prefilled)
        assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
        assert calls_of(whole["message"]["tool_calls"]) == [
            ("weather", {"unit": "c", "rain": True})
        ]
        deltas = [c["delta"] for c in chunks]
        assert not "".join(d.get("content") or "" for d in deltas)
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls_of(streamed_calls, streamed=True) == calls_of(whole["message"]["tool_calls"])


async def both_ways(client, body: dict) -> tuple[dict, list[dict]]:
    """A chat's one choice, whole, and its streamed chunks' choices."""
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as streamed:
        events = await sse_events(streamed)
    return response.json()["choices"][0], [e["choices"][0] for e in events[:-1]]


@pytest.mark.anyio
async def test_auto_without_a_parser_is_a_400_naming_the_flags(char_model, shared_manager):
    async with running(char_model, shared_manager) as (_, client):
        response = await client.post("/v1/chat/completions", json=FORCED)
        assert "--enable-auto-tool-choice" in assert_error(response, 400, "tool_choice")["message"]
        ok = await client.post("/v1/chat/completions", json={**FORCED, "tool_choice": "none"})
        assert ok.status_code == 200
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes"):
        async with running(char_model, shared_manager, tool_call_parser="nope"):
            pass


def test_the_cli_wants_a_parser_with_auto_tool_choice():
    result = subprocess.run(
        [sys.executable, "-m", "loomllm.cli.main", "serve", "smollm2", "--enable-auto-tool-choice"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in result.stderr
