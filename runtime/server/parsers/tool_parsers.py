"""Tool calls read out of a model's own text, for tool_choice "auto" (`--tool-call-parser`).

Streamed deltas and whole answers take the same path, so both give the same content and calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from loomllm.server.parsers.held_text import tag_prefix_length

# "hermes": each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as the
# chat templates of Qwen2.5, Qwen3 and Hermes 2 Pro / 3 teach their models.
START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def call_id() -> str:
    """A fresh tool call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


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
    try:  # an escaped lone surrogate ("\ud83d") decodes to no text: not a call we can send
        name.encode(), text.encode()
    except UnicodeEncodeError:
        return None
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def split_answer(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None: none) and calls, read as one streamed delta."""
    delta, _ = AutoToolDeltas(parallel).next(0, text, "stop")
    assert delta is not None
    # A message's calls have no "index": that is a delta's, to merge streamed pieces.
    calls = [
        {k: v for k, v in call.items() if k != "index"} for call in delta.get("tool_calls", [])
    ]
    return delta.get("content") or None, calls


def finish_reason(called: bool, engine_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an answer that made calls and stopped by itself."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


@dataclass(slots=True)
class _Choice:
    held: str = ""  # text not sent yet: blanks, a tag's start, or a call's body
    in_call: bool = False
    blanks: str = ""  # the blanks before the tag now open: content again if it is no call
    calls: int = 0


class AutoToolDeltas:
    """A streamed chat's deltas when the model may call tools: content as it comes, each
    call whole once its closing tag arrives (`parallel` false: the first call only).

    The content is the text before the first call, its trailing blanks dropped; text after a
    call is dropped, as vLLM drops it. A tag not followed by `{`, or a block whose JSON is not
    a call (cut short by max_tokens, say), is text like any other.
    """

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self._choices: dict[int, _Choice] = {}

    def next(
        self, index: int, text: str, finish: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
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
        content = ""
        calls: list[Any] = []
        state.held = ""

        def as_text(piece: str) -> None:  # text outside calls: content until the first call
            nonlocal content
            if state.calls == 0:
                content += piece

        while True:
            if state.in_call:
                opening = text.lstrip()
                if opening and not opening.startswith("{"):  # the tag was text
                    as_text(state.blanks + START)
                    state.in_call = False
                    continue
                end = text.find(END)
                if end < 0 and not last:
                    state.held = text
                    return content, calls
                body = text if end < 0 else text[:end]
                call = parse_call(body)
                if call is None:
                    as_text(state.blanks + START + (body if end < 0 else body + END))
                elif state.calls == 0 or self.parallel:
                    calls.append({"index": state.calls, **call})
                    state.calls += 1
                state.in_call, text = False, "" if end < 0 else text[end + len(END) :]
                continue
            start = text.find(START)
            if start >= 0:
                before = text[:start]
                as_text(before.rstrip())  # blanks before a call are dropped
                state.blanks = before[len(before.rstrip()) :]
                state.in_call, text = True, text[start + len(START) :]
                continue
            if last:
                as_text(text)
                return content, calls
            # Hold back what may start a tag, and trailing blanks, which a call would drop.
            keep = tag_prefix_length(text, START)
            sendable = text[: len(text) - keep]
            stripped = sendable.rstrip()
            as_text(stripped)
            state.held = sendable[len(stripped) :] + text[len(text) - keep :]
            return content, calls
