"""A thinking model's reasoning split out of its answer (`loom serve --reasoning-parser NAME`,
vLLM's flag): the text inside `<think>...</think>` is the message's `reasoning`, the rest its
content. Whole answers and streamed deltas take the same path, so they split alike.

- "deepseek_r1" (DeepSeek R1 and its distills, QwQ): the template may open `<think>` in the
  prompt, so everything up to `</think>` is reasoning, all of it if the answer was cut first.
- "qwen3": reasoning only when the answer opens with `<think>` (with enable_thinking: false
  the template closes an empty one in the prompt, and the answer is all content).

Blanks between `</think>` and the content are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.server.held_text import tag_prefix_length

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(slots=True)
class _Choice:
    mode: str = "opening"  # "opening" (the start tag may come), "reasoning", "after", "content"
    held: str = ""


class ReasoningDeltas:
    """Splits each choice's new text into (reasoning, content) pieces as it streams."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, "
                             f"got {parser!r}")  # fmt: skip
        self.parser = parser
        self._choices: dict[int, _Choice] = {}

    def next(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """The reasoning and the content in `text` (what may still be a tag is held back);
        `last`: the choice's final text, everything held is let go."""
        state = self._choices.setdefault(index, _Choice())
        text, state.held = state.held + text, ""
        reasoning = content = ""
        if state.mode == "opening":
            opened = text.lstrip()
            if opened.startswith(START):
                state.mode, text = "reasoning", opened[len(START):]
            elif START.startswith(opened) and not last:
                state.held = text  # maybe the start tag, not whole yet
                return "", ""
            else:
                state.mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        if state.mode == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = 0 if last else tag_prefix_length(text, END)
                reasoning, state.held = text[: len(text) - keep], text[len(text) - keep:]
                text = ""
            else:
                reasoning, text, state.mode = text[:end], text[end + len(END):], "after"
        if state.mode == "after":  # blanks after the reasoning are held until text comes
            if text.strip():
                state.mode, text = "content", text.lstrip()
            else:
                state.held, text = ("" if last else text), ""
        if state.mode == "content":
            content = text
        if last:
            del self._choices[index]
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content (None: none)."""
    reasoning, content = ReasoningDeltas(parser).next(0, text, last=True)
    return reasoning or None, content or None
