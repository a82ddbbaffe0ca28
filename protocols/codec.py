"""msgpack encoding of message dataclasses through a registry of type codes; no pickle anywhere.

A frame body is `[type_code, [field, ...]]`; decoding checks every field against its annotation.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

from loomllm.protocols.errors import MalformedMessageError, UnknownMessageError

NUMPY_EXT_CODE = 1
# Plain numeric dtypes only: an object dtype would let bytes become Python objects.
_ALLOWED_ARRAY_KINDS = frozenset("biuf")

T = TypeVar("T")
Encoder = Callable[[Any], Any]
Decoder = Callable[[Any, Any], Any]  # (value, where: the path for errors)

_class_by_code: dict[int, type] = {}
_code_by_class: dict[type, int] = {}
_fields_by_class: dict[type, tuple[tuple[str, Encoder | None, Decoder, str], ...]] = {}


def message(code: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a frozen dataclass as a message with a unique type code."""

    def register(cls: type[T]) -> type[T]:
        if code in _class_by_code:
            raise ValueError(f"type code {code} is taken by {_class_by_code[code].__name__}")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be a message")
        _class_by_code[code] = cls
        _code_by_class[cls] = code
        return cls

    return register


def registered_messages() -> dict[int, type]:
    """Every registered message class by type code (tests walk this)."""
    return dict(_class_by_code)


def encode(msg: Any) -> bytes:
    """Encode a registered message to a frame body.

    Fields go by annotation: nested messages as field lists, enums by value, numpy arrays as
    msgpack ext (dtype, shape, raw bytes).
    """
    cls = type(msg)
    try:
        code = _code_by_class[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not a registered message") from None
    return msgpack.packb([code, _encode_dataclass(msg)], default=_encode_ext, use_bin_type=True)


def decode(body: bytes) -> Any:
    """Decode a frame body into its message; MalformedMessageError for anything off.

    Every field is checked here, so a malformed body fails with an error naming the field,
    never deeper inside the receiver.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, ext_hook=_decode_ext, strict_map_key=True)
    except MalformedMessageError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for garbage input
        raise MalformedMessageError(f"frame body is not valid msgpack: {exc!r}") from exc
    if not (isinstance(obj, list) and len(obj) == 2 and type(obj[0]) is int):
        raise MalformedMessageError("frame body must be [type_code, fields]")
    code, fields = obj
    cls = _class_by_code.get(code)
    if cls is None:
        raise UnknownMessageError(f"unknown message type code {code}")
    return _decode_dataclass(cls, fields, cls.__name__)


def dataclass_fields(obj: Any) -> list[Any]:
    """A dataclass's fields as a plain list (what a frame holds for it), for JSON."""
    return _encode_dataclass(obj)


def from_dataclass_fields(cls: type[T], fields: Any) -> T:
    """The inverse of dataclass_fields, every field checked: MalformedMessageError naming
    the first one that does not fit its annotation."""
    return _decode_dataclass(cls, fields, cls.__name__)  # type: ignore[no-any-return]


# -- fields -------------------------------------------------------------------------
#
# Decoders take the value and `where`, the path to it for error messages. The path is
# formatted only when a check fails, because a step message holds thousands of fields and a
# string per field would cost more than the checks. A path is a str (the message name) or a
# tuple (parent path, step): a str step is appended as is (".field"), an int step is a list
# index, a 1-tuple step is a map key.

Where = Any


def _where_text(where: Where) -> str:
    steps = []
    while isinstance(where, tuple):
        where, step = where
        if isinstance(step, str):
            steps.append(step)
        elif isinstance(step, int):
            steps.append(f"[{step}]")
        else:
            steps.append(f"[{step[0]!r}]")
    return where + "".join(reversed(steps))


def _field_specs(cls: type) -> tuple[tuple[str, Encoder | None, Decoder, str], ...]:
    """Per field: name, encoder (None: sent as is), decoder, and its path step."""
    specs = _fields_by_class.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        specs = tuple(
            (f.name, *_compile(hints[f.name]), "." + f.name)
            for f in dataclasses.fields(cls)
            if f.init
        )
        _fields_by_class[cls] = specs
    return specs


def _encode_dataclass(obj: Any) -> list[Any]:
    return [
        getattr(obj, name) if enc is None else enc(getattr(obj, name))
        for name, enc, _, _ in _field_specs(type(obj))
    ]


def _decode_dataclass(cls: type, fields: Any, where: Where) -> Any:
    specs = _field_specs(cls)
    if type(fields) is not list or len(fields) != len(specs):
        raise MalformedMessageError(
            f"{_where_text(where)}: expected a list of {len(specs)} fields, got {_describe(fields)}"
        )
    kwargs = {
        name: dec(value, (where, step))
        for (name, _, dec, step), value in zip(specs, fields, strict=True)
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a message's own __post_init__ validation
        raise MalformedMessageError(f"{_where_text(where)}: {exc}") from exc


def _compile(tp: Any) -> tuple[Encoder | None, Decoder]:
    """Build the (encode, decode-and-check) pair for one annotation; encode None = as is."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return None, lambda v, where: v
    if origin in (typing.Union, types.UnionType):
        return _compile_union(typing.get_args(tp))
    if origin is typing.Literal:
        allowed = frozenset((type(value), value) for value in typing.get_args(tp))
        names = ", ".join(map(repr, typing.get_args(tp)))
        return None, _checker(
            lambda v: isinstance(v, str | int) and (type(v), v) in allowed, f"one of {names}"
        )
    if origin in (list, tuple):
        item_t = typing.get_args(tp)[0]
        make = list if origin is list else tuple
        if item_t in _SCALAR_TYPES:
            return None, _scalar_sequence_decoder(item_t, make)
        item_enc, item_dec = _compile(item_t)

        def dec_seq(v: Any, where: Where) -> Any:
            _check(type(v) is list, v, where, "a list")
            return make([item_dec(x, (where, i)) for i, x in enumerate(v)])

        if item_enc is None:
            return None, dec_seq
        return (lambda v: [item_enc(x) for x in v]), dec_seq
    if origin in (dict, collections.abc.Mapping):  # a Mapping decodes as a dict
        key_t, value_t = typing.get_args(tp)
        if key_t is int:  # msgpack maps take only str keys here (strict_map_key)
            return _compile_int_keyed(value_t)
        if key_t is str and value_t in (int, str, bool):
            return None, _scalar_map_decoder(key_t, value_t)
        key_enc, key_dec = _compile(key_t)
        val_enc, val_dec = _compile(value_t)

        def dec_map(v: Any, where: Where) -> dict[Any, Any]:
            _check(type(v) is dict, v, where, "a map")
            return {key_dec(k, where): val_dec(x, (where, (k,))) for k, x in v.items()}

        if key_enc is None and val_enc is None:
            return None, dec_map
        key_enc = key_enc or _identity
        val_enc = val_enc or _identity
        return (lambda v: {key_enc(k): val_enc(x) for k, x in v.items()}), dec_map
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):

        def dec_nested(v: Any, where: Where) -> Any:
            return _decode_dataclass(tp, v, where)

        return _encode_dataclass, dec_nested
    if isinstance(tp, type) and issubclass(tp, enum.Enum):

        def dec_enum(v: Any, where: Where) -> Any:
            try:
                return tp(v)
            except ValueError:
                raise MalformedMessageError(
                    f"{_where_text(where)}: {v!r} is not a {tp.__name__}"
                ) from None

        return (lambda v: v.value), dec_enum
    if tp is float:
        return None, _checker(lambda v: type(v) in (float, int), "a number", float)
    if tp is np.ndarray:
        return None, _checker(lambda v: isinstance(v, np.ndarray), "an array")
    if tp in (int, str, bytes, bool, type(None)):
        return None, _checker(lambda v: type(v) is tp, tp.__name__)
    raise TypeError(f"no wire encoding for annotation {tp!r}")


def _compile_int_keyed(value_t: Any) -> tuple[Encoder, Decoder]:
    """dict[int, V] on the wire: a list of [key, value] pairs."""
    val_enc, val_dec = _compile(value_t)
    val_enc = val_enc or _identity

    def dec(v: Any, where: Where) -> dict[int, Any]:
        _check(type(v) is list, v, where, "a list of [key, value] pairs")
        out = {}
        for i, pair in enumerate(v):
            _check(type(pair) is list and len(pair) == 2, pair, (where, i), "a [key, value] pair")
            _check(type(pair[0]) is int, pair[0], (where, i), "an int key")
            out[pair[0]] = val_dec(pair[1], (where, (pair[0],)))
        return out

    return (lambda v: [[k, val_enc(x)] for k, x in v.items()]), dec


def _identity(value: Any) -> Any:
    return value


# Element types whose lists are checked in one pass (token ids, request ids, logprobs).
_SCALAR_TYPES = (int, str, bool, float)


def _scalar_sequence_decoder(item_t: type, make: type) -> Decoder:
    allowed = {float, int} if item_t is float else {item_t}

    def dec(v: Any, where: Where) -> Any:
        _check(type(v) is list, v, where, "a list")
        if not allowed.issuperset(map(type, v)):
            i, bad = next((i, x) for i, x in enumerate(v) if type(x) not in allowed)
            _check(False, bad, (where, i), "a number" if item_t is float else item_t.__name__)
        if item_t is float:
            return make(map(float, v))
        return v if make is list else make(v)

    return dec


def _scalar_map_decoder(key_t: type, value_t: type) -> Decoder:
    key_dec, value_dec = _compile(key_t)[1], _compile(value_t)[1]

    def dec(v: Any, where: Where) -> Any:
        _check(type(v) is dict, v, where, "a map")
        if not ({key_t}.issuperset(map(type, v)) and {value_t}.issuperset(map(type, v.values()))):
            for k, x in v.items():  # name the first bad entry
                key_dec(k, where)
                value_dec(x, (where, (k,)))
        return v

    return dec


def _compile_union(options: tuple[Any, ...]) -> tuple[Encoder | None, Decoder]:
    non_none = [t for t in options if t is not type(None)]
    if len(non_none) != 1:
        raise TypeError(f"only `X | None` unions can cross the wire, not {options!r}")
    enc, dec = _compile(non_none[0])

    def dec_optional(v: Any, where: Where) -> Any:
        return None if v is None else dec(v, where)

    if enc is None:
        return None, dec_optional
    return (lambda v: None if v is None else enc(v)), dec_optional


def _checker(
    ok: Callable[[Any], bool], what: str, convert: Callable[[Any], Any] = _identity
) -> Decoder:
    def dec(v: Any, where: Where) -> Any:
        _check(ok(v), v, where, what)
        return convert(v)

    return dec


def _check(ok: bool, value: Any, where: Where, what: str) -> None:
    if not ok:
        raise MalformedMessageError(
            f"{_where_text(where)}: expected {what}, got {_describe(value)}"
        )


def _describe(value: Any) -> str:
    text = _shown(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _shown(value: Any, depth: int = 0) -> str:
    """repr for an error message, with bytes as their length only: a malformed message can
    carry a secret (a lease token) that must not reach a log."""
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if depth < 3 and isinstance(value, list | tuple):
        return (
            "["
            + ", ".join(_shown(v, depth + 1) for v in value[:8])
            + (", ...]" if len(value) > 8 else "]")
        )
    if depth < 3 and isinstance(value, dict):
        items = list(value.items())[:8]
        return (
            "{"
            + ", ".join(f"{_shown(k, depth + 1)}: {_shown(v, depth + 1)}" for k, v in items)
            + "}"
        )
    return repr(value)


# -- numpy arrays as msgpack ext --------------------------------------------------------


def _encode_ext(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ALLOWED_ARRAY_KINDS:
            raise TypeError(f"arrays of dtype {obj.dtype} cannot cross the wire")
        # tobytes() is C order whatever the layout; the shape is the original's (0-d stays 0-d).
        payload = msgpack.packb([obj.dtype.str, list(obj.shape), obj.tobytes()])
        return msgpack.ExtType(NUMPY_EXT_CODE, payload)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _decode_ext(code: int, data: bytes) -> Any:
    if code != NUMPY_EXT_CODE:
        raise MalformedMessageError(f"unknown msgpack ext code {code}")
    try:
        dtype_str, shape, raw = msgpack.unpackb(data, raw=False)
        dtype = np.dtype(dtype_str)
        if dtype.kind not in _ALLOWED_ARRAY_KINDS:
            raise ValueError(f"dtype {dtype} is not allowed")
        # frombuffer shares the frame's read-only bytes; the copy lets receivers write to it.
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except MalformedMessageError:
        raise
    except Exception as exc:
        raise MalformedMessageError(f"bad numpy array ext: {exc}") from exc
