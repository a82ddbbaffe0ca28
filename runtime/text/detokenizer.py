"""Incremental detokenization and stop strings: one request's new token ids in, text out.

The output processor feeds `update` each step and streams `get_next_output_text` (as vLLM v1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loomllm.text.tokenizer import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the classic prefix/read-offset decode below
    DecodeStream = None  # type: ignore[assignment,misc]

REPLACEMENT = "\ufffd"  # what a decoder yields for bytes that are not (yet) valid UTF-8
# Prompt tokens decoded ahead of the output, so the first output token decodes in context
# (e.g. SentencePiece drops a leading space at the start of a decode, not mid-sequence).
MIN_CONTEXT, MAX_CONTEXT = 4, 24


class IncrementalDetokenizer:
    """Text of one request's output tokens, streamed; stop strings cut it off.

    Uses `tokenizers.decoders.DecodeStream`, and falls back to re-decoding a short window of
    ids (vLLM's prefix/read offsets) if it is missing or fails. Text is produced once its
    bytes form whole UTF-8 characters; anything still pending is flushed at finish.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        # As vLLM: stop strings count only once more than min_tokens tokens are out; one
        # that ends sooner is text like any other.
        self.min_tokens = min_tokens
        self._num_tokens = 0
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the output
        # Only an excluded stop string must never be shown, so only then is text held back.
        excluded = self.stop if not include_stop_str_in_output else ()
        self._num_held = max(map(len, excluded), default=1) - 1
        self._num_sent = 0  # chars of output_text returned by delta calls
        self._flushed = False
        context = self._context(prompt_token_ids)
        # _ids[_prefix:_read] decoded to the last text produced; _ids[_read:] is still pending.
        self._ids = list(context)
        self._prefix, self._read = 0, len(context)
        while self._read and self._decode(self._ids[: self._read]).endswith(REPLACEMENT):
            self._read -= 1  # the prompt ends inside a character: its first bytes are pending
        self._stream = self._new_stream(context)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append the text of `new_token_ids`; returns the stop string they completed, if any.

        On a stop string, output_text ends right before it (right after it with
        include_stop_str_in_output) and the request must finish: text after it is dropped,
        and so are tokens of later updates. `stop_terminated`: the last token is an eos or
        stop token id; as in vLLM its text is left out unless include_stop_str_in_output.
        """
        if self.stop_reason is not None or not new_token_ids:
            return None
        self._num_tokens += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        return self._append("".join([self._decode_next(t) for t in new_token_ids]))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: all of it, or (delta) what earlier delta calls did not return.

        Until finished, the last max(len(stop)) - 1 characters are held back so that a stop
        string that is not complete yet is never shown, not even in part.
        """
        if finished and not self._flushed:
            self._flushed = True
            if self.stop_reason is None:
                self._append(self._flush())
        done = finished or self.stop_reason is not None
        end = len(self.output_text) - (0 if done else self._num_held)
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._num_sent:
            return ""
        text, self._num_sent = self.output_text[self._num_sent : end], end
        return text

    def _append(self, text: str) -> str | None:
        """Add text and look for stop strings in it, including ones that began earlier."""
        if not text:
            return None
        start = len(self.output_text)
        self.output_text += text
        if self._num_tokens <= self.min_tokens:
            return None
        # The stop string completed first wins (the one a char-by-char stream would see first).
        found: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (found is None or (i + len(s), i) < found[:2]):
                found = (i + len(s), i, s)
        if found is None:
            return None
        end, i, self.stop_reason = found
        self.output_text = self.output_text[: end if self.include_stop_str_in_output else i]
        return self.stop_reason

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.inner, token_id)
            except Exception:
                # E.g. "Invalid prefix encountered": a decoder whose output is not monotonic
                # (vLLM issue 17448). The window decode below needs no such property.
                self._stream = None
            else:
                if text:
                    self._prefix, self._read = self._read, len(self._ids)
                return text or ""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def _flush(self) -> str:
        """At finish: the text of pending ids, incomplete characters decoded as U+FFFD."""
        if self._read == len(self._ids):
            return ""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return text[len(done) :]

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix of at least MIN_CONTEXT ids that starts on a character."""
        tail = list(prompt_token_ids[-MAX_CONTEXT:])
        for n in range(min(MIN_CONTEXT, len(tail)), len(tail) + 1):
            suffix = tail[len(tail) - n :]
            if not self._decode(suffix).startswith(REPLACEMENT):
                return suffix
        return []

    def _new_stream(self, context: list[int]) -> Any:
        if DecodeStream is None:
            return None
        try:
            stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            # Step through the context one id at a time and drop its text. (DecodeStream(ids=...)
            # would instead emit the context's text when it ends inside a character.)
            for token_id in context:
                stream.step(self.tokenizer.inner, token_id)
        except Exception:
            return None  # the window decode in _decode_next takes over
        return stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.inner.decode(ids, skip_special_tokens=self.skip_special_tokens)
