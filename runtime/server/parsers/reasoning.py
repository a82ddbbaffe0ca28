"""A thinking model's reasoning split out of its answer (`loom serve --reasoning-parser NAME`).

The text inside `<think>...</think>` is the message's `reasoning`, the rest its content.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomllm.server.parsers.held_text import tag_prefix_length

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
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(PARSERS)}, got {parser!r}"
            )
        self.parser = parser
        self._choices: dict[int, _Choice] = {}

    def next(self, index: int, text: str, last: bool, prompt: str | None = None) -> tuple[str, str]:
        """The reasoning and the content in `text` (what may still be a tag is held back);
        `last`: the choice's final text, everything held is let go; `prompt`: the text the
        answer follows (read at the choice's first text)."""
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice(mode=_mode_after(prompt))
        text, state.held = state.held + text, ""
        reasoning = content = ""
        if state.mode == "opening":
            opened = text.lstrip()
            if opened.startswith(START):
                state.mode, text = "reasoning", opened[len(START) :]
            elif START.startswith(opened) and not last:
                state.held = text  # maybe the start tag, not whole yet
                return "", ""
            else:
                # deepseek_r1 (R1, its distills, QwQ) reads all up to `</think>` as reasoning,
                # all of the answer if it is cut first, because its template may open the tag
                # unseen; qwen3 reasons only when the answer opens with `<think>`.
                state.mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        if state.mode == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = 0 if last else tag_prefix_length(text, END)
                reasoning, state.held = text[: len(text) - keep], text[len(text) - keep :]
                text = ""
            else:
                reasoning, text, state.mode = text[:end], text[end + len(END) :], "after"
        if state.mode == "after":  # newlines after the reasoning are dropped, not indentation
            text = text.lstrip("\r\n")
            if text:
                state.mode = "content"
        if state.mode == "content":
            content = text
        if last:
            del self._choices[index]
        return reasoning, content


def split_reasoning(
    parser: str, text: str, prompt: str | None = None
) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content (None: none).

    It takes the streaming path with all its text at once, so both split alike.
    """
    reasoning, content = ReasoningDeltas(parser).next(0, text, last=True, prompt=prompt)
    return reasoning or None, content or None


def _mode_after(prompt: str | None) -> str:
    """Where an answer to `prompt` starts: inside a think block the prompt left open, after
    one it closed at its very end, or where its own first text decides ("opening").

    Thinking templates (Qwen3-2507, DeepSeek R1) and prefilled answers leave `<think>` open;
    Qwen3 with enable_thinking: false ends the prompt with a closed block.
    """
    if prompt is None:
        return "opening"
    start, end = prompt.rfind(START), prompt.rfind(END)
    if start > end:
        return "reasoning"
    if end >= 0 and not prompt[end + len(END) :].strip():
        return "after"
    return "opening"
