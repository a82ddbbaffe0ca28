"""Tool calls read out of a model's own text, for tool_choice "auto" (`loom serve
--enable-auto-tool-choice --tool-call-parser hermes`, vLLM's flags): whole answers, and
streamed deltas that hold back what may turn out to be a call.

"hermes": each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as the
chat templates of Qwen2.5, Qwen3 and Hermes 2 Pro / 3 teach their models. As in vLLM, the
message's content is the text before the first call, and a call whose JSON does not parse
leaves the whole answer as text (streamed: that call's own text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from runtime.server.held_text import tag_prefix_length
from runtime.server.tool_calls import call_id

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def parse_call(body: str) -> dict[str, Any] | None:
    """One call's JSON as OpenAI's tool call object; None if it is not one."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def split_answer(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None: none) and calls."""
    first = text.find(START)
    if first < 0:
        return text, []
    calls, at = [], first
    while at >= 0:
        end = text.find(END, at)
        call = parse_call(text[at + len(START): len(text) if end < 0 else end])
        if call is None:
            return text, []  # not calls after all
        calls.append(call)
        at = -1 if end < 0 else text.find(START, end)
    return text[:first].rstrip() or None, calls


def finish_reason(called: bool, engine_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an answer that made calls and stopped by itself."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


@dataclass(slots=True)
class _Choice:
    held: str = ""  # text not sent yet: blanks, a tag's start, or a call's body
    in_call: bool = False
    calls: int = 0


class AutoToolDeltas:
    """A streamed chat's deltas when the model may call tools: content as it comes, each
    call whole once its closing tag arrives. Trailing blanks are held, so the content
    streamed is the whole answer's content."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}

    def next(self, index: int, text: str, finish: str | None) -> tuple[dict[str, Any] | None,
                                                                       str | None]:  # fmt: skip
        """The delta for new `text` (None: nothing to send yet) and the finish reason."""
        state = self._choices.setdefault(index, _Choice())
        content, calls = self._advance(state, state.held + text, finish is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish is not None:
            del self._choices[index]
            return delta, finish_reason(state.calls > 0, finish)
        return delta or None, None

    def _advance(self, state: _Choice, text: str, last: bool) -> tuple[str, list[Any]]:
        content, calls = "", []
        while True:
            if state.in_call:
                end = text.find(END)
                if end < 0 and not last:
                    state.held = text
                    return content, calls
                body = text if end < 0 else text[:end]
                call = parse_call(body)
                if call is None:  # not a call: its text is content
                    content += START + (body if end < 0 else body + END)
                else:
                    calls.append({"index": state.calls, **call})
                    state.calls += 1
                state.in_call, text = False, "" if end < 0 else text[end + len(END):]
                continue
            start = text.find(START)
            if start >= 0:
                if state.calls == 0:
                    content += text[:start].rstrip()  # blanks before a call are dropped
                state.in_call, text = True, text[start + len(START):]
                continue
            if last:
                state.held = ""
                return content + (text if state.calls == 0 else ""), calls
            # Hold what may be the start of a tag, and trailing blanks (dropped if a call
            # follows); after a call, text outside calls is dropped (as in whole answers).
            keep = tag_prefix_length(text, START)
            sendable = text[: len(text) - keep]
            stripped = sendable.rstrip()
            state.held = sendable[len(stripped):] + text[len(text) - keep:]
            if state.calls == 0:
                content += stripped
            return content, calls
