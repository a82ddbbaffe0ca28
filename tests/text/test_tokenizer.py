"""loomllm.text.tokenizer: ids, special tokens and chat templates equal to transformers' own, and
the module stays light (no torch, no transformers) in the user's process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO_ROOT
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import AutoTokenizer

from loomllm.text.tokenizer import Tokenizer
from loomllm.workers.models.sources import prepare_model_dir, resolve_model

TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n  indented",
    "naïve café déjà vu, Ærøskøbing, Straße",
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 flags",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}',
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "Ελληνικά, русский текст, עברית, العربية",
    "",
    "1234567890 3.14159 -42 1e10",
]

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi! 😀"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": 'Write <b>bold</b> & "quoted" text.'},
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return prepare_model_dir(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


@pytest.fixture(scope="module")
def theirs(smollm2_dir: Path):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, theirs, add_special_tokens):
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours, theirs, skip_special_tokens):
    for text in TEXTS:
        ids = ours.encode(text)
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens) == expected, text


@pytest.mark.parametrize("messages", [SYSTEM_USER, MULTI_TURN], ids=["system+user", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    # What the engine sends: the rendered text encoded without adding special tokens again.
    expected_ids = theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ours.encode(text, add_special_tokens=False) == list(expected_ids)


def test_chat_template_defaults_to_a_generation_prompt(ours):
    assert ours.apply_chat_template(SYSTEM_USER).endswith("<|im_start|>assistant\n")


def test_smollm2_special_tokens(ours, theirs):
    assert 2 in ours.eos_token_ids  # <|im_end|>
    assert ours.inner.id_to_token(2) == "<|im_end|>"
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.vocab_size == len(theirs)
    assert all(ours.is_special(i) for i in theirs.all_special_ids)
    assert not ours.is_special(ours.encode("hello")[0])


def test_text_parts_are_joined(ours):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = ours.apply_chat_template([{"role": "user", "content": parts}])
    assert as_parts == ours.apply_chat_template([{"role": "user", "content": "first\nsecond"}])


@pytest.mark.parametrize(
    "messages, field",
    [
        ("hello", "messages"),
        ([], "messages"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]"),
        ([{"content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
            r"messages\[0\]\.content\[1\]",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            r"messages\[0\]\.content\[0\]\.text",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be JSON",
        ),
    ],
)
def test_bad_messages_name_the_field(ours, messages, field):
    with pytest.raises(ValueError, match=field):
        ours.apply_chat_template(messages)


def test_import_stays_light():
    code = "import loomllm.text.tokenizer, loomllm.text.detokenizer, sys; print('torch' in sys.modules, 'transformers' in sys.modules)"  # noqa: E501
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


# ---- tiny model directories: template sources, variables, errors -------------------------


# Indented block tags on their own lines exercise trim_blocks and lstrip_blocks.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if message['role'] == 'assistant' %}
        {% generation %}A: {{ message['content'] }}{% endgeneration %}
    {% else %}
  {{ message['role'] | upper }}: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}{{ ns.n }}{{ eos_token }}{{ extra | default('') }}"""


def make_dir(
    tmp_path: Path, template: str | list | None = None, files: dict[str, object] | None = None
) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(["<s>", "</s>", "<unk>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}  # the older config form
    config: dict = {
        "bos_token": "<s>",
        "eos_token": eos,
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_rich_template_matches_transformers(tmp_path):
    model_dir = make_dir(tmp_path, RICH_TEMPLATE)
    ours, theirs = Tokenizer.from_model_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "f", "description": "<a> & 'b' é"}}]
    messages = [*MULTI_TURN, {"role": "stop", "content": "x"}, {"role": "user", "content": "y"}]
    for kwargs in ({}, {"tools": tools}, {"extra": "!"}, {"eos_token": "[override]"}):
        for add in (True, False):
            expected = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add, **kwargs
            )
            text = ours.apply_chat_template(messages, add_generation_prompt=add, **kwargs)
            assert text == expected


def test_named_templates_and_template_files(tmp_path):
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ messages | length }}"},
    ]
    tok = Tokenizer.from_model_dir(make_dir(tmp_path, named))
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == "D1"
    assert tok.apply_chat_template(chat, tools=[{"name": "f"}]) == "T1"
    assert tok.apply_chat_template(chat, chat_template="tool_use") == "T1"
    inline = "inline {{ messages[0].content }}"
    assert tok.apply_chat_template(chat, chat_template=inline) == "inline hi"
    # A chat_template.jinja file wins over the config's templates, as in transformers.
    other = make_dir(tmp_path / "f", "config", {"chat_template.jinja": "file"})
    assert Tokenizer.from_model_dir(other).apply_chat_template(chat) == "file"


def test_template_errors_are_value_errors(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_model_dir(make_dir(tmp_path)).apply_chat_template(chat)
    raising = make_dir(tmp_path / "r", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_model_dir(raising).apply_chat_template(chat)
    broken = make_dir(tmp_path / "b", "{% for %}")
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_model_dir(broken).apply_chat_template(chat)
    sandboxed = make_dir(tmp_path / "s", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        Tokenizer.from_model_dir(sandboxed).apply_chat_template(chat)
    # The template's own code failing on a message's values (Llama 3.1's takes
    # `message.tool_calls|length`): a ValueError too, not whatever Python raised.
    counting = Tokenizer.from_model_dir(
        make_dir(
            tmp_path / "c", "{% for m in messages %}{{ m.content | length / m.n }}{% endfor %}"
        )
    )
    with pytest.raises(ValueError, match="failed on these messages: ZeroDivisionError"):
        counting.apply_chat_template([{"role": "user", "content": "hi", "n": 0}])
    assert counting.apply_chat_template([{"role": "user", "content": "hi", "n": 2}]) == "1.0"
    calls = Tokenizer.from_model_dir(
        make_dir(tmp_path / "t", "{% for m in messages %}{{ m.tool_calls | length }}{% endfor %}")
    )
    assert calls.apply_chat_template([{"role": "assistant", "tool_calls": [{}, {}]}]) == "2"
    for bad in (5, "call", [1]):
        with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls must be a list of tool"):
            calls.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": bad}])


def test_template_helpers(tmp_path):
    template = "{{ {'k': '<é>'} | tojson }} {{ strftime_now('%Y') | length }}"
    tok = Tokenizer.from_model_dir(make_dir(tmp_path, template))
    assert tok.apply_chat_template([{"role": "user", "content": ""}]) == '{"k": "<é>"} 4'


def test_eos_ids_come_from_every_config(tmp_path):
    configs = {
        "generation_config.json": {"eos_token_id": [3, 4]},
        "config.json": {"eos_token_id": 0},
    }
    model_dir = make_dir(tmp_path, files=configs)
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.eos_token_ids == {0, 1, 3, 4}  # 1 is </s>, the tokenizer's eos_token
    assert tok.bos_token_id == 0
    assert tok.is_special(1) and not tok.is_special(3)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.json", "garbage"),
        ("tokenizer.json", '{"model": 3}'),
        ("tokenizer.json", b"\xff\xfe"),
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", b"\xff\xfe"),
    ],
)
def test_corrupt_tokenizer_files_are_value_errors_naming_the_file(tmp_path, name, content):
    model_dir = make_dir(tmp_path)
    file = model_dir / name
    file.write_bytes(content) if isinstance(content, bytes) else file.write_text(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(file))} is not "):
        Tokenizer.from_model_dir(model_dir)


def test_tool_call_arguments_reach_the_template_as_objects(ours):
    """OpenAI sends a call's arguments as a JSON string; templates (Qwen2.5's, Llama 3.1's)
    render `arguments | tojson` or iterate them: they get the object, as vLLM gives them."""
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }};"
        "{% endfor %}{% endfor %}"
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"unit": "c"}'},
    }
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = ours.apply_chat_template(messages, chat_template=template)
    assert text == 'weather{"unit": "c"};'
    assert call["function"]["arguments"] == '{"unit": "c"}'  # the caller's copy untouched
    empty = {**call, "function": {"name": "ping", "arguments": ""}}
    assert (
        ours.apply_chat_template(
            [{"role": "assistant", "tool_calls": [empty]}], chat_template=template
        )
        == "ping{};"
    )


PREFILLED = [
    [*SYSTEM_USER, {"role": "assistant", "content": "The answer is"}],
    [*SYSTEM_USER, {"role": "assistant", "content": "  Four, since  "}],  # spaces both ends
    [
        *MULTI_TURN,
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Sure."}, {"type": "text", "text": "<b>bold"}],
        },
    ],
    # the final text appears earlier too: the prompt is cut after its last occurrence
    [{"role": "user", "content": "Say ok"}, {"role": "assistant", "content": "ok"}],
    # the final text is also part of the end-of-turn markup after it (<|im_end|>)
    [*SYSTEM_USER, {"role": "assistant", "content": "e"}],
    [*SYSTEM_USER, {"role": "assistant", "content": "<"}],
    [*SYSTEM_USER, {"role": "assistant", "content": ""}],  # prefill nothing: the header
]


def joined_parts(messages: list[dict]) -> list[dict]:
    return [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


@pytest.mark.parametrize(
    "messages",
    PREFILLED,
    ids=["plain", "spaces", "parts", "repeated", "in-markup", "tag-start", "empty"],
)
def test_continue_final_message_matches_transformers(ours, theirs, messages, tmp_path):
    """The prompt ends inside the final message, exactly where transformers ends it: with
    SmolLM2's template, and with one that trims the message (RICH_TEMPLATE keeps it)."""
    pairs = [(ours, theirs)]
    trimming = RICH_TEMPLATE.replace("message['content'] }}", "message['content'] | trim }}")
    for template in (RICH_TEMPLATE, trimming):
        model_dir = make_dir(tmp_path / str(len(pairs)), template)
        reference = AutoTokenizer.from_pretrained(model_dir)
        pairs.append((Tokenizer.from_model_dir(model_dir), reference))
    for mine, reference in pairs:
        text = mine.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )
        expected = reference.apply_chat_template(  # text parts joined, as vLLM joins them
            joined_parts(messages),
            tokenize=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        assert text == expected
        assert not text.endswith("\n") or not messages[-1]["content"]


@pytest.mark.parametrize(
    "kwargs, messages, match",
    [
        ({"continue_final_message": True}, PREFILLED[0], "set one of them at most"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            [*SYSTEM_USER, {"role": "assistant", "tool_calls": []}],
            "needs the final message's",
        ),
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "chat_template": "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}",
            },
            PREFILLED[0],
            "does not render the final message's text as it is",
        ),
    ],
)
def test_continue_final_message_errors(ours, kwargs, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages, **kwargs)


def test_bad_words_are_encoded_alone_and_after_a_space(ours, theirs):
    """vLLM's rule: a word as it starts a text, and after a space when that spells it with
    another first token in as many tokens (a word-start token, "Ġhello"); token ids from
    transformers' tokenizer."""
    from loomllm.engine.input_checks import with_bad_words_encoded
    from loomllm.protocols.sampling import SamplingParams

    words = ["hello", "New York", "   spaced"]
    params = with_bad_words_encoded(SamplingParams(bad_words=words), ours)
    alone = [tuple(theirs.encode(w.lstrip(), add_special_tokens=False)) for w in words]
    spaced = [tuple(theirs.encode(" " + w.lstrip(), add_special_tokens=False)) for w in words]
    assert spaced[0] != alone[0] and len(spaced[0]) == len(alone[0])  # "Ġhello"
    assert params.bad_words_token_ids == (alone[0], spaced[0], alone[1], spaced[1], alone[2])
