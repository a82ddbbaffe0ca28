"""msgpack encoding of message dataclasses through a registry of type codes.

A message body on the wire is `[type_code, [field, ...]]`. Fields are encoded by their
annotations: nested message dataclasses as field lists, enums by value, numpy arrays as
msgpack ext (dtype, shape, raw bytes). Decoding checks every field against its
annotation, so a malformed body fails here with a MalformedMessageError naming the
field, never deeper inside the receiver. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

from protocols.errors import MalformedMessageError, UnknownMessageError

NUMPY_EXT_CODE = 1
# Plain numeric dtypes only: an object dtype would let bytes become Python objects.
_ALLOWED_ARRAY_KINDS = frozenset("biuf")

T = TypeVar("T")
Encoder = Callable[[Any], Any]
Decoder = Callable[[Any, str], Any]

_class_by_code: dict[int, type] = {}
_code_by_class: dict[type, int] = {}
_fields_by_class: dict[type, tuple[tuple[str, Encoder, Decoder], ...]] = {}


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
    """Encode a registered message to a frame body."""
    cls = type(msg)
    try:
        code = _code_by_class[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not a registered message") from None
    return msgpack.packb([code, _encode_dataclass(msg)], default=_encode_ext, use_bin_type=True)


def decode(body: bytes) -> Any:
    """Decode a frame body into its message; MalformedMessageError for anything off."""
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


# -- fields -------------------------------------------------------------------------


def _field_specs(cls: type) -> tuple[tuple[str, Encoder, Decoder], ...]:
    specs = _fields_by_class.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        specs = tuple(
            (f.name, *_compile(hints[f.name])) for f in dataclasses.fields(cls) if f.init
        )
        _fields_by_class[cls] = specs
    return specs


def _encode_dataclass(obj: Any) -> list[Any]:
    return [enc(getattr(obj, name)) for name, enc, _ in _field_specs(type(obj))]


def _decode_dataclass(cls: type, fields: Any, where: str) -> Any:
    specs = _field_specs(cls)
    if not isinstance(fields, list) or len(fields) != len(specs):
        raise MalformedMessageError(
            f"{where}: expected a list of {len(specs)} fields, got {_describe(fields)}"
        )
    kwargs = {
        name: dec(value, f"{where}.{name}")
        for (name, _, dec), value in zip(specs, fields, strict=True)
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a message's own __post_init__ validation
        raise MalformedMessageError(f"{where}: {exc}") from exc


def _identity(value: Any) -> Any:
    return value


def _compile(tp: Any) -> tuple[Encoder, Decoder]:
    """Build the (encode, decode-and-check) pair for one annotation."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return _identity, lambda v, where: v
    if origin in (typing.Union, types.UnionType):
        return _compile_union(typing.get_args(tp))
    if origin in (list, tuple):
        item_enc, item_dec = _compile(typing.get_args(tp)[0])
        make = list if origin is list else tuple

        def dec_seq(v: Any, where: str) -> Any:
            _check(isinstance(v, list), v, where, "a list")
            return make(item_dec(x, f"{where}[{i}]") for i, x in enumerate(v))

        return (lambda v: [item_enc(x) for x in v]), dec_seq
    if origin is dict:
        key_t, value_t = typing.get_args(tp)
        key_enc, key_dec = _compile(key_t)
        val_enc, val_dec = _compile(value_t)

        def dec_map(v: Any, where: str) -> dict[Any, Any]:
            _check(isinstance(v, dict), v, where, "a map")
            return {key_dec(k, where): val_dec(x, f"{where}[{k!r}]") for k, x in v.items()}

        return (lambda v: {key_enc(k): val_enc(x) for k, x in v.items()}), dec_map
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):

        def dec_nested(v: Any, where: str) -> Any:
            return _decode_dataclass(tp, v, where)

        return _encode_dataclass, dec_nested
    if isinstance(tp, type) and issubclass(tp, enum.Enum):

        def dec_enum(v: Any, where: str) -> Any:
            try:
                return tp(v)
            except ValueError:
                raise MalformedMessageError(f"{where}: {v!r} is not a {tp.__name__}") from None

        return (lambda v: v.value), dec_enum
    if tp is float:
        return _identity, _checker(lambda v: type(v) in (float, int), "a number", float)
    if tp is np.ndarray:
        return _identity, _checker(lambda v: isinstance(v, np.ndarray), "an array")
    if tp in (int, str, bytes, bool, type(None)):
        return _identity, _checker(lambda v: type(v) is tp, tp.__name__)
    raise TypeError(f"no wire encoding for annotation {tp!r}")


def _compile_union(options: tuple[Any, ...]) -> tuple[Encoder, Decoder]:
    non_none = [t for t in options if t is not type(None)]
    if len(non_none) != 1:
        raise TypeError(f"only `X | None` unions can cross the wire, not {options!r}")
    enc, dec = _compile(non_none[0])
    return (lambda v: None if v is None else enc(v)), (
        lambda v, where: None if v is None else dec(v, where)
    )


def _checker(
    ok: Callable[[Any], bool], what: str, convert: Callable[[Any], Any] = _identity
) -> Decoder:
    def dec(v: Any, where: str) -> Any:
        _check(ok(v), v, where, what)
        return convert(v)

    return dec


def _check(ok: bool, value: Any, where: str, what: str) -> None:
    if not ok:
        raise MalformedMessageError(f"{where}: expected {what}, got {_describe(value)}")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


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
        # frombuffer shares the frame's bytes; copy so receivers may write to it.
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except MalformedMessageError:
        raise
    except Exception as exc:
        raise MalformedMessageError(f"bad numpy array ext: {exc}") from exc
