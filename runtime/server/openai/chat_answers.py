"""A chat choice's answer shaped from the engine's text: a whole message or streamed deltas.

It carries the demanded or auto-read tool calls, the reasoning split out, and `echo`'s text first.
"""

from __future__ import annotations

from typing import Any

from loomllm.server.openai.schemas import ChatRequest
from loomllm.server.openai.tool_calls import ToolCallDeltas
from loomllm.server.parsers.reasoning import ReasoningDeltas, split_reasoning
from loomllm.server.parsers.tool_parsers import AutoToolDeltas, finish_reason, split_answer

Delta = dict[str, Any]


def chat_message(
    req: ChatRequest, text: str, finish: str | None, prompt: str | None = None
) -> tuple[Delta, str | None]:
    """A whole answer's message and finish_reason; `prompt`: the rendered prompt it follows."""
    if req.tool_calls is not None and (calls := req.tool_calls.calls(text)) is not None:
        called: Delta = {"role": "assistant", "content": None, "tool_calls": calls}
        return called, req.tool_calls.finish(finish)
    message: Delta = {"role": "assistant"}
    if req.reasoning_parser is not None:
        reasoning, content = split_reasoning(req.reasoning_parser, text, prompt)
        # vLLM's field was reasoning_content, now reasoning: clients read one or the other.
        message["reasoning"] = message["reasoning_content"] = reasoning
        text = content or ""
    text = req.echo + text
    if req.auto_tools:
        message["content"], made = split_answer(text, req.parallel_tool_calls)
        if made:
            message["tool_calls"] = made
        return message, finish_reason(bool(made), finish)
    message["content"] = text if text or req.reasoning_parser is None else None
    return message, finish


class ChatDeltas:
    """A streamed chat's deltas, choice by choice. The logprobs entries of an output whose
    text is all held back (a tag not whole yet) are held too, and go with the next delta:
    over the stream every entry is sent once and in order, though one may come a chunk
    before the rest of its text."""

    def __init__(self, req: ChatRequest) -> None:
        self.req = req
        self._demanded = ToolCallDeltas(req.tool_calls) if req.tool_calls else None
        self._auto = AutoToolDeltas(req.parallel_tool_calls) if req.auto_tools else None
        parser = req.reasoning_parser
        self._thinking = ReasoningDeltas(parser) if parser is not None else None
        self._held_logprobs: dict[int, list[Any]] = {}
        self._unechoed: set[int] = set()  # choices whose echo goes to the tool-call parser
        self._prompts: dict[int, str | None] = {}  # each choice's prompt, till its first text

    def first(self, index: int, prompt: str | None = None) -> Delta:
        """The choice's first delta; `prompt`: the rendered prompt it answers."""
        self._prompts[index] = prompt
        if self._demanded is not None:
            return self._demanded.first()
        if self._auto is not None and self.req.echo:  # the echo may open a call: parse it
            self._unechoed.add(index)
            return {"role": "assistant", "content": ""}
        return {"role": "assistant", "content": self.req.echo}

    def next(
        self, index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None
    ) -> tuple[Delta | None, str | None, dict[str, Any] | None]:
        """The delta for new `text` (None: nothing to send yet), the finish reason, and the
        logprobs to send with it (chat's {"content": [...]})."""
        delta: Delta | None
        reasoning = ""
        if self._demanded is not None:
            delta, finish = self._demanded.next(index, text, finish)
        else:
            if self._thinking is not None:
                reasoning, text = self._thinking.next(
                    index, text, finish is not None, self._prompts.pop(index, None)
                )
            if self._auto is not None:
                if index in self._unechoed:
                    self._unechoed.discard(index)
                    text = self.req.echo + text
                delta, finish = self._auto.next(index, text, finish)
            else:
                delta = {"content": text} if text or self._thinking is None else None
        if reasoning:
            delta = {"reasoning": reasoning, "reasoning_content": reasoning, **(delta or {})}
        if delta is None and finish is not None:
            delta = {}
        if logprobs is not None:
            self._held_logprobs.setdefault(index, []).extend(logprobs["content"])
        if delta is None:
            return None, None, None
        entries = self._held_logprobs.pop(index, None)
        return delta, finish, None if entries is None else {"content": entries}
