"""Tools, tool calls and their checks, shared by the tool-call and parser tests."""

from __future__ import annotations

import json

from loomllm.server.parsers.tool_parsers import AutoToolDeltas

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
    "required": ["unit", "rain"],
}


TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "description": "no parameters"}},
]


WEATHER_CALL = (
    '<tool_call>\n{"name": "weather", "arguments": {"unit": "c", "rain": true}}\n</tool_call>'
)


def calls_of(calls: list[dict], streamed: bool = False) -> list[tuple[str, dict]]:
    """Each call's name and arguments; a message's calls have no "index", deltas' do."""
    for k, call in enumerate(calls):
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call.get("index") == (k if streamed else None)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(answer: str, cuts: list[int]) -> tuple[str | None, list]:
    """The answer fed to AutoToolDeltas in pieces ending at `cuts`: content and calls."""
    deltas, content, calls, start = AutoToolDeltas(), "", [], 0
    for end in cuts:
        finish = "stop" if end == len(answer) else None
        delta, reason = deltas.next(0, answer[start:end], finish)
        start = end
        if delta is None:
            continue
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            assert call["index"] == len(calls)
            calls.append(call)
    assert reason == ("tool_calls" if calls else "stop")
    return content or None, calls
