"""SamplingParams: how to pick tokens and when to stop, validated, shared by engine and worker.

Names and defaults follow vLLM; a bad value raises ValueError naming the field and its range.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType, UnionType
from typing import Any, get_args, get_origin, get_type_hints


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's StructuredOutputsParams): exactly one
    of a JSON schema, any JSON object, a regular expression, a choice of strings, or an EBNF
    grammar (xgrammar's dialect). The workers compile it; one that does not compile fails
    its request alone, with a ValueError on its stream."""

    json: str | None = None  # a JSON schema, as JSON text (a dict is dumped)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict | bool):
            object.__setattr__(self, "json", _json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + ["json_object"] * (self.json_object is True)
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, json_object, "
                f"regex, choice, grammar; got {given or 'none'}"
            )
        _bool("structured_outputs.json_object", self.json_object)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None:
            try:
                schema = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI allows
MAX_N = 128  # choices per prompt in one request body: more would flood the batch


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One SamplingParams field's rule, stated once: SamplingParams checks it, and the server's
    request bodies (runtime/server/bodies/) take a field of the same name with it."""

    low: float | None = None  # of the value, or of each item of a list
    high: float | None = None
    low_open: bool = False
    in_body: bool = True  # OpenAI's and vLLM's bodies set it by this name
    doc: str = ""  # its description in the server's OpenAPI document
    body_high: int | None = None  # a request body's cap, tighter than the engine's
    token_ids: bool = False  # ids of the model's vocabulary (the OpenAPI bounds them)
    min_items: int = 0  # of a list


def spec(default: Any, **rule: Any) -> Any:
    """A dataclass field with `default` and its FieldSpec (read by field_specs())."""
    return field(default=default, metadata={"spec": FieldSpec(**rule)})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; checked on construction, before any scheduling."""

    n: int = spec(1, low=1, body_high=MAX_N, doc="choices per prompt")
    temperature: float = spec(1.0, low=0.0)
    top_p: float = spec(1.0, low=0.0, low_open=True, high=1.0)
    top_k: int = spec(0, low=-1, doc="0 or -1: no top-k")
    min_p: float = spec(0.0, low=0.0, high=1.0)
    seed: int | None = spec(
        None,
        doc="each of the n choices samples with seed + its index, which must fit in 64 bits too",
    )
    presence_penalty: float = spec(0.0, low=-2.0, high=2.0)
    frequency_penalty: float = spec(0.0, low=-2.0, high=2.0)
    repetition_penalty: float = spec(1.0, low=0.0, low_open=True)
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = spec((), low=0, token_ids=True)
    ignore_eos: bool = spec(False)
    max_tokens: int | None = spec(16, low=1, in_body=False)  # None: up to max_model_len
    min_tokens: int = spec(0, low=0, doc="at most max_tokens (else 400)")
    # Number of top logprobs per token, besides the sampled one.
    logprobs: int | None = spec(None, low=0, high=MAX_LOGPROBS, in_body=False)
    # Logprob of each prompt token (after the first) plus this many top logprobs at each
    # prompt position; None: off. Such a request skips the prefix cache (all of it is computed).
    prompt_logprobs: int | None = spec(None, low=0, high=MAX_LOGPROBS, in_body=False)
    skip_special_tokens: bool = spec(True)
    include_stop_str_in_output: bool = spec(False)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Added to the token's logit before penalties and sampling, every step (OpenAI's
    # logit_bias, in token ids; the server keeps OpenAI's [-100, 100]). Held read-only (a
    # copy of the mapping given), and left out of the hash, as a mapping cannot be hashed.
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    # Only these token ids can be sampled (vLLM's), held sorted and once each; None: any.
    # min_tokens still bans eos.
    allowed_token_ids: tuple[int, ...] | None = spec(
        None,
        low=0,
        token_ids=True,
        min_items=1,
        doc="only these can be sampled; with min_tokens, not only eos and stop_token_ids",
    )
    structured_outputs: StructuredOutputsParams | None = None
    # Words the model may not write (vLLM's): the engine encodes each, as it is and after a
    # space, into bad_words_token_ids, and the last token of such a sequence is banned
    # whenever the output so far ends with the rest of it.
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    # Token sequences banned that way: bad_words' encodings, and any given here directly.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # Keep only the prompt's last k tokens (vLLM's left truncation; a text prompt keeps its
    # BOS first); -1: as many as leave room for max_tokens; None: a longer prompt is refused.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        # Accept what vLLM accepts: a single stop string, lists instead of tuples, None.
        for name in ("stop", "bad_words"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is None or isinstance(value, list):
                object.__setattr__(self, name, tuple(value or ()))
        kind = self.output_kind
        if type(kind) is int:  # a bool is no output kind
            object.__setattr__(self, "output_kind", _enum("output_kind", kind))
        self._validate()

    def _validate(self) -> None:
        for name, check in _CHECKS.items():
            check(name, getattr(self, name))
        # Sequence i of n samples with seed + i (vLLM's rule): each must fit too.
        if self.seed is not None and self.seed + self.n - 1 > _INT64[1]:
            raise ValueError(
                f"seed + n - 1 must fit in 64 bits, got seed {self.seed} with n {self.n}"
            )
        stop = self.stop
        if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        self._validate_token_filters()
        self._validate_bad_words()
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (type(truncate) is int and truncate == -1):
            _int("truncate_prompt_tokens", truncate, low=1)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def _validate_token_filters(self) -> None:
        """Check, then hold in their normal form: a read-only bias of floats, the allowed
        ids sorted and once each (a request's size on the wire is bounded by the vocabulary)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
            for token_id, value in bias.items():
                if type(token_id) is not int or not 0 <= token_id <= _INT64[1]:
                    raise ValueError(
                        f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                    )
                try:
                    _number("logit_bias", value)
                except ValueError as exc:
                    raise ValueError(f"{exc} (token {token_id})") from None
            normal = MappingProxyType({k: float(v) for k, v in bias.items()})
            object.__setattr__(self, "logit_bias", normal)
        allowed = self.allowed_token_ids
        if allowed is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if not isinstance(words, tuple) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(
                f"bad_words must be a list of words (non-blank strings), got {words!r}"[:300]
            )
        sequences = self.bad_words_token_ids
        if sequences is None or isinstance(sequences, list):
            sequences = tuple(sequences or ())
        if not isinstance(sequences, tuple) or not all(
            isinstance(seq, tuple | list) and seq for seq in sequences
        ):
            raise ValueError(
                f"bad_words_token_ids must be a list of non-empty token id "
                f"lists, got {sequences!r}"[:300]
            )
        for seq in sequences:
            for token_id in seq:
                _int("bad_words_token_ids", token_id, low=0)
        object.__setattr__(self, "bad_words_token_ids", tuple(map(tuple, sequences)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON or self.top_k == 1


def replace_checked(params: SamplingParams, **changes: Any) -> SamplingParams:
    """`params` with `changes` the caller knows keep it valid, not checked again: a
    request's n children share its checked bias and allowed ids (a full vocabulary's worth,
    checked once, not n times)."""
    child = copy.copy(params)
    for name, value in changes.items():
        object.__setattr__(child, name, value)
    return child


_GREEDY_EPSILON = 1e-5


def _enum(name: str, value: int) -> RequestOutputKind:
    try:
        return RequestOutputKind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[k.name for k in RequestOutputKind]}") from None


_INT64 = (-(2**63), 2**63 - 1)  # what crosses the wire (msgpack)


def _int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{name} must fit in 64 bits, got {value!r}")
    _range(name, value, low, high, low_open=False)


def _number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    # An int beyond 64 bits could not cross the wire (and may overflow a float).
    if type(value) is int and not -(2**63) <= value < 2**63:  # type: ignore[operator]
        raise ValueError(
            f"{name} must be a finite number, got an integer of {value.bit_length()} bits"
        )
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _range(name, value, low, high, low_open)  # type: ignore[arg-type]


def _range(name: str, value: float, low: float | None, high: float | None, low_open: bool) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def _bool(name: str, value: object) -> None:
    if type(value) is not bool:
        raise ValueError(f"{name} must be true or false, got {value!r}")


def field_specs() -> dict[str, tuple[type, bool, bool, FieldSpec]]:
    """Each specified field: (its scalar type, whether None is allowed, whether it is a
    list of them, its FieldSpec), by name."""
    hints = get_type_hints(SamplingParams)
    specs = {}
    for f in fields(SamplingParams):
        if "spec" not in f.metadata:
            continue
        hint = hints[f.name]
        members = get_args(hint) if isinstance(hint, UnionType) else (hint,)
        (kind,) = [k for k in members if k is not type(None)]
        is_list = get_origin(kind) is tuple
        scalar = get_args(kind)[0] if is_list else kind
        specs[f.name] = (scalar, type(None) in members, is_list, f.metadata["spec"])
    return specs


def _check_of(scalar: type, optional: bool, is_list: bool, rule: FieldSpec) -> Any:
    """The check of one specified field's value."""

    def one(name: str, value: object) -> None:
        if scalar is bool:
            _bool(name, value)
        elif scalar is int:
            _int(name, value, rule.low, rule.high)  # type: ignore[arg-type]
        else:
            _number(name, value, rule.low, rule.high, rule.low_open)

    def check(name: str, value: object) -> None:
        if value is None and optional:
            return
        if not is_list:
            one(name, value)
            return
        if not isinstance(value, tuple | list) or len(value) < rule.min_items:
            least = f" of at least {rule.min_items}" if rule.min_items else ""
            raise ValueError(f"{name} must be a list{least} of token ids, got {value!r}"[:300])
        for item in value:
            one(name, item)

    return check


_CHECKS = {name: _check_of(*args) for name, args in field_specs().items()}
