"""The detokenizer: streamed text equals a whole decode; stop strings end it and never show.

Every test runs twice: on tokenizers' DecodeStream and on the window-decode fallback.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.models import save_tiny_tokenizer
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from loomllm.text import detokenizer
from loomllm.text.detokenizer import IncrementalDetokenizer
from loomllm.text.tokenizer import Tokenizer
from loomllm.workers.models.sources import prepare_model_dir, resolve_model

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Naïve café owners in Zürich said “déjà vu”.\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "日本語の文章と中文文本混在。한국어 텍스트도 있습니다. Ελληνικά και русский текст.\n"
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧 🇫🇷🇯🇵 and math ∑∫√∞ ≠ ≤ ≥, arrows ← → ↔.\n"
    "<|im_start|>assistant\nSpecial tokens<|im_end|> in the middle <|endoftext|> too.\n"
    "   Whitespace\t\ttabs   and  double  spaces.\r\n"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(prepare_model_dir(resolve_model("smollm2")))


@pytest.fixture(params=["DecodeStream", "window"], autouse=True)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    return request.param


def feed(
    d: IncrementalDetokenizer,
    ids: list[int],
    rng: random.Random | None = None,
    stop_terminated: bool = False,
) -> tuple[list[str], list[str], str | None]:
    """Feed `ids` in chunks of 1-3 (1 without rng); returns deltas, cumulative texts, stop."""
    deltas, shown, stop, i = [], [], None, 0
    while i < len(ids) and stop is None:
        n = rng.randint(1, 3) if rng else 1
        chunk, i = ids[i : i + n], i + n
        stop = d.update(chunk, stop_terminated and i >= len(ids))
        finished = stop is not None or i >= len(ids)
        shown.append(d.get_next_output_text(finished, delta=False))
        deltas.append(d.get_next_output_text(finished, delta=True))
    return deltas, shown, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_join_to_the_whole_decode(tok, skip_special_tokens):
    rng = random.Random(1234)
    ids = tok.encode(CORPUS)
    prompt = tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(150):
        start = rng.randrange(len(ids))  # windows start and end inside multi-byte characters too
        out = ids[start : start + rng.randint(1, 40)]
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        deltas, shown, _ = feed(d, out, rng)
        expected = tok.decode(out, skip_special_tokens)
        assert "".join(deltas) == shown[-1] == d.output_text == expected
        assert all(a == b[: len(a)] for a, b in zip(shown, shown[1:], strict=False))


def test_multibyte_characters_split_across_tokens(tok):
    text = "é😀👍🏽日本語🇫🇷"
    out = tok.encode(text)
    assert len(out) > 6  # byte-level pieces, not whole characters
    d = IncrementalDetokenizer(tok, tok.encode("Hi"))
    deltas, _, _ = feed(d, out)
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas)


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("Say 😀 now")
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, ids[:cut])
    deltas, _, _ = feed(d, ids[cut:])
    assert "".join(deltas) == tok.decode(ids)[len("Say") :]  # the output completes the emoji


def test_output_ending_inside_a_character_is_flushed_at_finish(tok):
    ids = tok.encode("ok 😀")
    out = ids[:-1]  # the emoji's last byte never comes
    d = IncrementalDetokenizer(tok, [])
    d.update(out, False)
    assert d.get_next_output_text(False, True) == "ok"
    assert d.get_next_output_text(True, True) == tok.decode(out)[len("ok") :]
    assert d.output_text == tok.decode(out)


def make_tiny(tmp_path: Path, kind: str) -> Tokenizer:
    if kind == "wordpiece":
        save_tiny_tokenizer(tmp_path)  # the tiny test models' tokenizer: "w1 w2 ..."
        return Tokenizer.from_model_dir(tmp_path)
    words = ["▁Hello", "▁world", "▁again", "!"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()  # drops the space of a decode's first word
    raw.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("kind", ["metaspace", "wordpiece"])
def test_first_token_is_decoded_in_the_prompt_context(tmp_path, kind):
    tiny = make_tiny(tmp_path, kind)
    prompt, out = ([0], [1, 3, 2]) if kind == "metaspace" else ([5, 6], [7, 8, 9])
    d = IncrementalDetokenizer(tiny, prompt)
    deltas, _, _ = feed(d, out)
    expected = tiny.decode(prompt + out)[len(tiny.decode(prompt)) :]
    assert "".join(deltas) == expected
    assert expected.startswith(" ")


def test_stop_string_across_tokens(tok):
    out = tok.encode("The answer is 42. Then more text.")
    d = IncrementalDetokenizer(tok, [], stop=["swer is 4"])
    deltas, shown, stop = feed(d, out)
    assert stop == "swer is 4"
    assert d.output_text == shown[-1] == "".join(deltas) == "The an"
    assert len(deltas) < len(out)


def test_stop_strings_count_only_after_min_tokens(tok):
    """vLLM's rule: a stop string ending within the first min_tokens tokens is plain text;
    the first one to end after them stops the output (one straddling the boundary too)."""
    out = tok.encode("one two one two one")
    words = [tok.decode(out[: i + 1]) for i in range(len(out))]
    ends = [i for i, text in enumerate(words) if text.endswith("one")]  # tokens ending "one"
    assert len(ends) == 3, words
    for min_tokens, expected in [
        (0, ""),
        (ends[0], ""),
        (ends[0] + 1, words[ends[1]][:-3]),
        (ends[1] + 1, words[ends[2]][:-3]),
    ]:
        d = IncrementalDetokenizer(tok, [], stop=["one"], min_tokens=min_tokens)
        deltas, _, stop = feed(d, out)
        assert stop == "one" and d.output_text == "".join(deltas) == expected, min_tokens
    d = IncrementalDetokenizer(tok, [], stop=["one"], min_tokens=len(out))
    assert feed(d, out)[2] is None and d.output_text == tok.decode(out)
    # A stop string that began among the first min_tokens and ends after them counts.
    d = IncrementalDetokenizer(tok, [], stop=["two one"], min_tokens=ends[1])
    assert feed(d, out)[2] == "two one" and d.output_text == words[ends[0]] + " "


def test_stop_text_after_it_in_the_same_token_is_dropped(tok):
    out = tok.encode("Hello there")
    assert tok.decode(out[:1]) == "Hello"
    for include, expected in [(False, "H"), (True, "Hell")]:
        d = IncrementalDetokenizer(tok, [], stop=["ell"], include_stop_str_in_output=include)
        assert d.update(out, False) == "ell"
        assert d.get_next_output_text(True, True) == d.output_text == expected
        assert d.update(tok.encode(" more"), False) is None  # late tokens are ignored
        assert d.output_text == expected


@pytest.mark.parametrize(
    "stops, expected",
    [
        (["qux", "baz", "bar b"], ("bar b", "foo ")),
        # The one completed first wins (as a char-by-char stream would see it), not the first listed
        # or the one that starts first: the result must not depend on how tokens are batched.
        (["bar baz", "r b"], ("r b", "foo ba")),
    ],
)
def test_earliest_stop_wins(tok, stops, expected):
    out = tok.encode("foo bar baz qux")
    for chunked in (False, True):
        d = IncrementalDetokenizer(tok, [], stop=stops)
        stop = feed(d, out)[2] if chunked else d.update(out, False)
        assert (stop, d.output_text) == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_never_show(tok, include):
    """Random stop strings cut from the text: what is shown is always a prefix of the final
    text, so no part of an excluded stop string is ever shown, and chunking never matters."""
    rng = random.Random(99)
    text = CORPUS.replace("<|", "< |")
    ids = tok.encode(text)
    full = tok.decode(ids)
    for _ in range(100):
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(full) - 8)
            stops.append(full[i : i + rng.randint(1, 8)])
        stops.append("never in the text")
        end, start, first = min((full.find(s) + len(s), full.find(s), s) for s in stops[:-1])
        expected = full[: end if include else start]
        results = set()
        for rng_or_none in (None, rng):
            d = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
            deltas, shown, stop = feed(d, ids, rng_or_none)
            assert stop == first
            assert "".join(deltas) == shown[-1] == d.output_text == expected
            for text_now in shown:
                assert expected.startswith(text_now)
            results.add((stop, d.output_text))
        assert len(results) == 1


def test_held_back_text_is_released_at_finish(tok):
    out = tok.encode("Hello world, hello")
    d = IncrementalDetokenizer(tok, [], stop=["NOT THERE"])  # holds back 8 characters
    d.update(out, False)
    assert d.get_next_output_text(False, False) == "Hello worl"
    assert d.get_next_output_text(False, True) == "Hello worl"
    assert d.get_next_output_text(True, True) == "d, hello"
    assert d.get_next_output_text(True, False) == "Hello world, hello"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text(tok, skip_special_tokens, include):
    """An eos or stop token's own text is left out unless include_stop_str_in_output (vLLM)."""
    out = tok.encode("Bye!\n") + [2]
    d = IncrementalDetokenizer(
        tok, [], skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include
    )
    deltas, _, stop = feed(d, out, stop_terminated=True)
    assert stop is None
    shown_eos = include and not skip_special_tokens
    assert "".join(deltas) == "Bye!\n" + ("<|im_end|>" if shown_eos else "")


def test_fallback_when_decode_stream_fails(tok, monkeypatch):
    class Failing:
        def __init__(self, skip_special_tokens: bool) -> None:
            self.steps = 0

        def step(self, tokenizer: object, token_id: int) -> str | None:
            self.steps += 1
            if self.steps > 6:
                raise Exception("Invalid prefix encountered")
            return None

    monkeypatch.setattr(detokenizer, "DecodeStream", Failing)
    out = tok.encode("Streaming 😀 survives a failing DecodeStream.")
    d = IncrementalDetokenizer(tok, tok.encode("abc"))
    deltas, _, _ = feed(d, out)
    assert "".join(deltas) == tok.decode(out)


def test_empty_update_and_bad_stop(tok):
    d = IncrementalDetokenizer(tok, [], stop=["x"])
    assert d.update([], False) is None
    assert d.get_next_output_text(False, True) == ""
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])
