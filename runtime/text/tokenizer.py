"""The model's tokenizer and chat template, loaded from its directory without transformers.

Engine intake encodes prompts and renders chats here; the detokenizer decodes with `inner`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special-token variables transformers hands every chat template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what transformers reads beside it: special tokens, eos ids,
    and chat templates rendered exactly as `AutoTokenizer.apply_chat_template` renders them."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
    ) -> None:
        self.inner = inner
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self.vocab_size: int = inner.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, token in inner.get_added_tokens_decoder().items() if token.special
        )
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat templates and eos ids from a HF dir."""
        path = Path(model_dir).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"model directory {path} has no tokenizer.json (a fast tokenizer)")
        inner = _load_tokenizer_json(path / "tokenizer.json")
        # transformers pads and truncates only when asked to; a tokenizer.json may enable both.
        inner.no_padding()
        inner.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        special = {
            name: content
            for name in SPECIAL_TOKEN_NAMES
            if (content := _token_content(config.get(name))) is not None
        }
        model_config = _read_json(path / "config.json")
        text_config = model_config.get("text_config")  # multimodal models nest the LM's config
        sources = [_read_json(path / "generation_config.json"), model_config, text_config or {}]
        eos = {i for source in sources for i in _ids(source.get("eos_token_id"))}
        eos |= _ids(inner.token_to_id(special.get("eos_token", "")))
        bos_id = inner.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
        return cls(
            inner,
            eos_token_ids=frozenset(eos),
            bos_token_id=bos_id,
            special_tokens=special,
            chat_templates=_load_chat_templates(path, config),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens=False for text that already has them (chats)."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            return self.inner.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # what tokenizers raises for a str that is no valid Unicode
            bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            if bad is None:
                raise
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {text[bad]!r} at index {bad}"
            ) from None

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A pair of texts as one input, as a cross-encoder reads it (BERT's "[CLS] first [SEP]
        second [SEP]"): its token ids, and each token's segment (token_type_ids)."""
        for text in (first, second):
            if not isinstance(text, str):
                raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        self.encode(first)  # a text that is no valid Unicode: the same ValueError
        self.encode(second)
        encoding = self.inner.encode(first, second)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (whole-sequence decode; see IncrementalDetokenizer for streaming)."""
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """True for added tokens marked special (those skip_special_tokens hides)."""
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Render `messages` as the model's prompt text; encode it with add_special_tokens=False
        (or pass tokenize=True, as in transformers, for the token ids).

        `tools` and `documents` reach the template as in transformers; other keyword arguments
        become template variables (e.g. enable_thinking); `chat_template` picks a named template
        or passes a template string. `continue_final_message`: the text ends inside the final
        message (a prefilled answer the model goes on with), not after its end-of-turn tokens.
        Bad messages or a template that rejects them: ValueError.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message goes on with the final message, "
                "add_generation_prompt starts a new one: set one of them at most"
            )
        chat = _prepare_messages(messages)
        if continue_final_message:
            chat[-1] = _marked_final_message(chat[-1])
        tools = kwargs.pop("tools", None)
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of JSON-schema dicts")
        template = self._template(kwargs.pop("chat_template", None), tools is not None)
        documents = kwargs.pop("documents", None)
        variables = _plain({**self.special_tokens, **kwargs})  # kwargs win, as in transformers
        try:
            text = template.render(
                variables,
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        except Exception as exc:  # the template's own code failed on these messages' values
            # (Llama 3.1's takes `message.tool_calls|length`: a TypeError on a number)
            raise ValueError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc
        text = _cut_at_marker(text) if continue_final_message else text
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, choice: str | None, has_tools: bool) -> jinja2.Template:
        templates = self.chat_templates
        if choice is None:
            if not templates:
                raise ValueError(
                    "this model has no chat template (no chat_template.jinja, none in "
                    "tokenizer_config.json): pass chat_template= (a template string), or "
                    "generate() from a prompt"
                )
            choice = "tool_use" if has_tools and "tool_use" in templates else "default"
            if choice not in templates:
                names = sorted(templates)
                raise ValueError(f"no default chat template: pass chat_template= one of {names}")
        source = templates.get(choice, choice)  # a template's name, or a template itself
        if (compiled := self._compiled.get(source)) is None:
            try:
                compiled = _ENV.from_string(source)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat_template does not compile: {exc}") from exc
            if len(self._compiled) >= MAX_COMPILED_TEMPLATES:
                # Templates passed in come and go with a server's requests: the oldest of
                # them is dropped, never one of the model's own.
                own = set(templates.values())
                stale = next((k for k in self._compiled if k not in own), None)
                if stale is not None:
                    del self._compiled[stale]
            self._compiled[source] = compiled
        return compiled


# Appended to the final message's text for continue_final_message: the prompt is cut where
# it renders. The space after it shows whether the template keeps a message's trailing
# blanks (then the message's own are kept) or trims them (then they go too).
_CONTINUE_MARKER = "LOOM_CONTINUE_FINAL_MESSAGE_HERE"  # plain text: templates may tojson it


def _marked_final_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError("continue_final_message needs the final message's text content")
    return {**message, "content": content + _CONTINUE_MARKER + " "}


def _cut_at_marker(text: str) -> str:
    """The rendered prompt up to the final message's end (its end-of-turn tokens dropped)."""
    at = text.rfind(_CONTINUE_MARKER)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final "
            "message's text as it is, so there is no place to go on from"
        )
    kept_blanks = text.startswith(" ", at + len(_CONTINUE_MARKER))
    return text[:at] if kept_blanks else text[:at].rstrip()


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant text for training masks; here its body just renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # As transformers: no HTML escaping (jinja's own tojson escapes <, >, &, ').
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Compiled templates kept: the model's own, and the latest ones passed in.
MAX_COMPILED_TEMPLATES = 32
# Chat templates are untrusted code from the Hub: sandboxed, immutable, as transformers runs them.
_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


def _prepare_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated plain copies; None values dropped and text parts joined, as vLLM/transformers."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content'")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(role := message.get("role"), str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string, got {role!r}")
        content = message.get("content")
        if isinstance(content, list | tuple):
            message["content"] = _join_text_parts(content, f"{where}.content")
        elif content is None and "tool_calls" not in message:
            raise ValueError(f"{where}.content is required (a string or a list of text parts)")
        elif content is not None and not isinstance(content, str):
            kind = type(content).__name__
            raise ValueError(f"{where}.content must be a string or list of text parts, not {kind}")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list | tuple) and all(isinstance(c, Mapping) for c in calls)
        ):
            raise ValueError(f"{where}.tool_calls must be a list of tool call objects")
        if calls is not None:
            message["tool_calls"] = [
                _with_parsed_arguments(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        chat.append(_plain(message))
    return chat


def _with_parsed_arguments(call: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """A tool call whose `function.arguments` (OpenAI's: a JSON string) is the object it
    spells, as chat templates read it (`arguments | tojson`, `arguments.items()`), as vLLM
    hands it to them."""
    function = call.get("function")
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        raise ValueError(
            f"{where}.function.arguments must be JSON, got {arguments[:80]!r}"
        ) from None
    return {**call, "function": {**function, "arguments": parsed}}


def _join_text_parts(parts: Sequence[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}[{j}] must be a {{'type': 'text', ...}} part, not {kind!r}")
        if not isinstance(text := part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _plain(value: Any) -> Any:
    """JSON-like copy of what a template may see: rich objects' methods stay out of the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    for base in (str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    return f"<{type(value).__name__}>"


def _load_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    # As transformers: template files, when present, replace the config's templates entirely.
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    for file in sorted(extra.glob("*.jinja")) if extra.is_dir() else []:
        templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    configured = config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in configured if isinstance(t, Mapping)}
    return {}


def _load_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:
        # tokenizers raises a bare Exception ("expected value at line 1 column 1") that
        # names neither the file nor the problem's kind: a corrupt or truncated download.
        raise ValueError(f"{path} is not a valid tokenizers file: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # the latter names no file
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    """Token ids from a config field: an int, a list of ints, or None."""
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
