"""protocols/ framing, codec and connection, with no processes.

Every registered message type gets a round trip and malformed-input checks (walked from
the registry, so a new type is covered without touching this file); MessageStream and
the HELLO/WELCOME handshake run over a real socketpair on asyncio and trio.
"""

from __future__ import annotations

import dataclasses
import enum
import socket
import types
import typing
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest
from anyio.abc import UNIXSocketStream
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from loomllm.protocols.codec import NUMPY_EXT_CODE, decode, encode, message, registered_messages
from loomllm.protocols.connection import MessageStream, client_handshake, server_handshake
from loomllm.protocols.errors import (
    FrameTooLargeError,
    MalformedMessageError,
    ProtocolError,
    TruncatedFrameError,
    UnexpectedMessageError,
    UnknownMessageError,
    VersionMismatchError,
)
from loomllm.protocols.framing import HEADER, FrameReader, encode_frame
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.messages import (
    PROTOCOL_VERSION,
    Attach,
    CachedRequests,
    ErrorReply,
    Hello,
    Lease,
    StatusRequest,
    Welcome,
)
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

FAST = settings(max_examples=50, deadline=None)
DTYPES = ["int32", "int64", "uint8", "float16", "float32", "float64", "bool", ">i4"]


@message(9001)
@dataclasses.dataclass(frozen=True, slots=True)
class ArrayProbe:
    """Test-only message: a required and an optional array at the top level."""

    array: np.ndarray
    maybe: np.ndarray | None
    note: str


@message(9002)
@dataclasses.dataclass(frozen=True, slots=True)
class IntKeyProbe:
    """Test-only message: a map with int keys (token ids), which msgpack maps here refuse."""

    bias: dict[int, float]


def test_int_keyed_maps_cross_as_pairs_and_bad_pairs_are_named() -> None:
    msg = IntKeyProbe({5: 1.5, 2**63 - 1: -100.0, 0: 0.0})
    assert msgpack.unpackb(encode(msg))[1] == [[[5, 1.5], [2**63 - 1, -100.0], [0, 0.0]]]
    assert decode(encode(msg)) == msg
    assert decode(msgpack.packb([9002, [[[7, 2]]]])).bias == {7: 2.0}  # an int value as float
    for bias, match in [
        ({"5": 1.0}, r"IntKeyProbe\.bias: expected a list of \[key, value\] pairs"),
        ([[5]], r"IntKeyProbe\.bias\[0\]: expected a \[key, value\] pair"),
        ([["5", 1.0]], r"IntKeyProbe\.bias\[0\]: expected an int key"),
        ([[True, 1.0]], r"IntKeyProbe\.bias\[0\]: expected an int key"),
        ([[5, "x"]], r"IntKeyProbe\.bias\[5\]: expected a number"),  # named by its key
    ]:
        expect_malformed([9002, [bias]], match=match)


# -- values built from annotations ----------------------------------------------------

ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
ARRAYS = hnp.arrays(
    st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
)
SIMPLE = {
    int: st.integers(-(2**63), 2**63 - 1),
    float: st.floats(allow_nan=False),
    str: st.text(),
    bytes: st.binary(),
    bool: st.booleans(),
    type(None): st.none(),
    Any: ANY_VALUE,
    np.ndarray: ARRAYS,
}


# SamplingParams validates itself: draw only values it accepts.
VALID_SAMPLING_PARAMS = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 50),
    seed=st.none() | st.integers(0, 2**31),
    stop=st.lists(st.text(min_size=1), max_size=2).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=2).map(tuple),
    max_tokens=st.none() | st.integers(1, 100),
    logprobs=st.none() | st.integers(0, 5),
    prompt_logprobs=st.none() | st.integers(0, 5),
    output_kind=st.sampled_from(list(RequestOutputKind)),
    logit_bias=st.none()
    | st.dictionaries(
        st.integers(0, 2**63 - 1), st.floats(allow_nan=False, allow_infinity=False), max_size=3
    ),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 1000), min_size=1, max_size=3),
)
VALID_LORA_REQUESTS = st.builds(
    LoRARequest,
    lora_name=st.text(min_size=1),
    lora_int_id=st.integers(1, 2**63 - 1),
    lora_path=st.text(min_size=1),
)
# CachedRequests' columns have one length.
VALID_CACHED_REQUESTS = st.lists(
    st.tuples(st.text(), st.lists(st.integers(0, 2**31), max_size=3), st.integers(0, 2**31)),
    max_size=4,
).map(
    lambda rows: (
        CachedRequests(*(list(column) for column in zip(*rows, strict=True)))
        if rows
        else CachedRequests([], [], [])
    )
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """Values of annotation `tp`, as the codec understands annotations."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=4)
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
    if tp is SamplingParams:
        return VALID_SAMPLING_PARAMS
    if tp is CachedRequests:
        return VALID_CACHED_REQUESTS
    if tp is LoRARequest:
        return VALID_LORA_REQUESTS
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=4)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{name: strategy_for(hints[name]) for name in field_names(tp)})
    return SIMPLE[tp]


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def plain(v: Any) -> Any:
    """A comparable form: dataclasses by type and fields, arrays by dtype, shape and bytes."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if dataclasses.is_dataclass(v):
        return (type(v), [plain(getattr(v, name)) for name in field_names(type(v))])
    if isinstance(v, dict):
        return (dict, {k: plain(x) for k, x in v.items()})
    if isinstance(v, list):
        return (list, [plain(x) for x in v])
    return (type(v), v)


BY_NAME = pytest.mark.parametrize(
    "cls", [c for _, c in sorted(registered_messages().items())], ids=lambda c: c.__name__
)


def wire_fields(cls: type, data: st.DataObject) -> tuple[int, list[Any]]:
    """[type_code, fields] of a drawn valid instance of `cls`, arrays left as opaque ext."""
    return msgpack.unpackb(encode(data.draw(strategy_for(cls))), raw=False)


def expect_malformed(body: Any, match: str | None = None) -> str:
    """Decode `body` (bytes, or an object to pack first); return the error's text."""
    with pytest.raises(MalformedMessageError, match=match) as info:
        decode(body if isinstance(body, bytes) else msgpack.packb(body))
    return str(info.value)


def test_error_text_shows_no_bytes_content() -> None:
    """A malformed Attach (an extra field) names what it got without its token's bytes."""
    token = bytes(range(65, 97))
    code = next(c for c, cls in registered_messages().items() if cls.__name__ == "Attach")
    text = expect_malformed([code, [token, token]])
    assert "<32 bytes>" in text and token.decode() not in text and "ABC" not in text


# -- every message type -----------------------------------------------------------------


@BY_NAME
@FAST
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    msg = data.draw(strategy_for(cls))
    assert plain(decode(encode(msg))) == plain(msg)


@BY_NAME
@settings(FAST, max_examples=5)
@given(data=st.data())
def test_malformed_fields_are_named(cls: type, data: st.DataObject) -> None:
    code, fields = wire_fields(cls, data)
    name, hints = cls.__name__, typing.get_type_hints(cls)
    expect_malformed([code, [*fields, 1]], match=rf"^{name}: expected a list of {len(fields)}")
    expect_malformed([code, {"a": 1}], match=rf"^{name}: expected a list of {len(fields)}")
    if fields:
        expect_malformed([code, fields[:-1]], match=rf"^{name}: expected a list")
    for i, field in enumerate(field_names(cls)):
        if hints[field] is Any:
            continue  # anything goes
        wrong = "text" if float in (hints[field], *typing.get_args(hints[field])) else 1.5
        error = expect_malformed([code, [*fields[:i], wrong, *fields[i + 1 :]]])
        assert error.startswith(f"{name}.{field}: expected")


@BY_NAME
@settings(FAST, max_examples=5)
@given(data=st.data())
def test_every_truncation_is_malformed(cls: type, data: st.DataObject) -> None:
    body = encode(data.draw(strategy_for(cls)))
    for end in range(len(body)):
        expect_malformed(body[:end])
    expect_malformed(body + b"\x00", match="not valid msgpack")


def test_errors_name_nested_fields() -> None:
    error = expect_malformed([1, ["1", "engine", 5]])
    assert error == "Hello.protocol_version: expected int, got str '1'"
    spec = ["model", "two", None]  # AcquireWorkers(spec: WorkerSpec, keep_alive, engine_id)
    expect_malformed([10, [spec, 0.0, "e"]], match=r"^AcquireWorkers\.spec\.world_size: ")
    model_info = ["m", "d", 1, 2, 3, 4, 5, "float32", "cpu", 0.5]
    expect_malformed(
        [11, ["g1", ["a", None], [1, 2], model_info, False, b"token"]],
        match=r"^WorkersAcquired\.sockets\[1\]: expected str",
    )
    # Deep paths, built only when a check fails: a list of lists, a map value, columns.
    cached = [["a", "b"], [[], [7, "8"]], [3, 4], []]
    step = [0, [], cached, {"a": 1, "b": 1}, []]
    expect_malformed(
        [43, [1, step]],
        match=(
            r"^ExecuteStep\.scheduler_output\.cached\.new_block_ids\[1\]\[1\]: expected int, "
            "got str"
        ),
    )
    step = [0, [], [["a"], [[]], [3], []], {"a": 1, "b": True}, []]
    expect_malformed(
        [43, [1, step]],
        match=(r"^ExecuteStep\.scheduler_output\.num_scheduled_tokens\['b'\]: expected int"),
    )
    step = [0, [], [["a", "b"], [[]], [3], []], {}, []]
    expect_malformed(
        [43, [1, step]],
        match=(r"^ExecuteStep\.scheduler_output\.cached: CachedRequests columns differ in length"),
    )
    expect_malformed(
        [44, [1, ["a"], [5], [0.5, "x"], [None], [], 0.0, [], [], []]],
        match=r"^StepResult\.logprobs\[1\]: expected a number",
    )


@pytest.mark.parametrize(
    "body", [5, "hello", {"a": 1}, [], [1], [1, [], 2], ["1", []], [True, []], [1.0, []]]
)
def test_body_that_is_not_type_code_and_fields(body: Any) -> None:
    expect_malformed(body, match=r"must be \[type_code, fields\]")


def test_unknown_type_code() -> None:
    with pytest.raises(UnknownMessageError, match="unknown message type code 9999"):
        decode(msgpack.packb([9999, []]))


@FAST
@given(st.binary(max_size=64))
def test_garbage_bytes_decode_or_raise_protocol_error(body: bytes) -> None:
    try:
        msg = decode(body)
    except ProtocolError:
        return
    assert type(msg) in registered_messages().values()


@FAST
@given(st.sampled_from(sorted(registered_messages())), st.lists(ANY_VALUE, max_size=10))
def test_random_fields_decode_or_raise_malformed(code: int, fields: list[Any]) -> None:
    try:
        msg = decode(msgpack.packb([code, fields]))
    except MalformedMessageError:
        return
    assert type(msg) is registered_messages()[code]


# -- numpy arrays -----------------------------------------------------------------------


@FAST
@given(ARRAYS, st.none() | ARRAYS)
def test_arrays_round_trip_writable(array: np.ndarray, maybe: np.ndarray | None) -> None:
    back = decode(encode(ArrayProbe(array, maybe, "n")))
    assert plain(back) == plain(ArrayProbe(array, maybe, "n"))
    assert back.array.flags.writeable  # the receiver owns its copy


@pytest.mark.parametrize("view", [lambda a: a[:, ::2], lambda a: a.T, np.asfortranarray])
def test_non_contiguous_arrays_round_trip(view: Any) -> None:
    array = view(np.arange(24, dtype=np.float32).reshape(4, 6))
    assert plain(decode(encode(ArrayProbe(array, None, ""))).array) == plain(array.copy())


def test_zero_dim_array_keeps_its_shape() -> None:
    assert decode(encode(ArrayProbe(np.array(5), None, ""))).array.shape == ()


@pytest.mark.parametrize("array", [np.array([1, "a"], dtype=object), np.zeros(2, complex)])
def test_non_numeric_arrays_are_refused_at_encode(array: np.ndarray) -> None:
    with pytest.raises(TypeError, match="cannot cross the wire"):
        encode(ArrayProbe(array, None, ""))


def array_ext(dtype: Any, shape: Any, raw: Any, code: int = NUMPY_EXT_CODE) -> bytes:
    ext = msgpack.ExtType(code, msgpack.packb([dtype, shape, raw]))
    return msgpack.packb([9001, [ext, None, ""]])


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (array_ext("|O", [1], b"\0" * 8), "dtype object is not allowed"),
        (array_ext("<U2", [1], b"\0" * 8), "is not allowed"),
        (array_ext("<i4", [3], b"\0" * 8), "bad numpy array ext"),
        (array_ext("<i4", [2**40], b"\0" * 8), "bad numpy array ext"),
        (array_ext("no such dtype", [1], b""), "bad numpy array ext"),
        (array_ext(5, "shape", 7), "bad numpy array ext"),
        (array_ext("<i4", [1], b"\0" * 4, code=7), "unknown msgpack ext code 7"),
        ([9001, ["not an array", None, ""]], r"ArrayProbe\.array: expected an array"),
    ],
)
def test_bad_array_ext_is_malformed(body: Any, match: str) -> None:
    expect_malformed(body, match=match)


# -- framing ----------------------------------------------------------------------------


@FAST
@given(st.lists(st.binary(max_size=40), max_size=6), st.data())
def test_frame_reader_any_chunking(bodies: list[bytes], data: st.DataObject) -> None:
    wire = b"".join(encode_frame(b) for b in bodies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    if data.draw(st.booleans(), label="byte by byte"):
        cuts = list(range(len(wire)))
    reader, got = FrameReader(), []
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += reader.feed(wire[start:end])
    reader.close()
    assert got == bodies


def test_oversized_length_fails_before_the_body() -> None:
    reader = FrameReader(max_frame_size=10)
    assert reader.feed(encode_frame(b"x" * 10)) == [b"x" * 10]  # the maximum itself is fine
    assert reader.feed(HEADER.pack(11)[:2]) == []
    with pytest.raises(FrameTooLargeError, match="frame of 11 bytes; the maximum is 10"):
        reader.feed(HEADER.pack(11)[2:])


@pytest.mark.parametrize("leftover", [b"\x00", b"\x00\x00\x00\x05abc"])
def test_close_mid_frame_is_truncated(leftover: bytes) -> None:
    reader = FrameReader()
    assert reader.feed(encode_frame(b"ok") + leftover) == [b"ok"]
    with pytest.raises(TruncatedFrameError, match=f"{len(leftover)} bytes of an unfinished"):
        reader.close()


def test_encode_frame_refuses_oversized_body() -> None:
    assert encode_frame(b"x" * 10, 10) == HEADER.pack(10) + b"x" * 10
    with pytest.raises(FrameTooLargeError, match="11 bytes exceeds the maximum frame size of 10"):
        encode_frame(b"x" * 11, 10)


# -- MessageStream and the handshake over a socketpair --------------------------------


@asynccontextmanager
async def stream_pair(max_frame_size: int = 1024) -> AsyncIterator[tuple[MessageStream, Any]]:
    """A MessageStream and the raw byte stream at the other end of a socketpair."""
    a, b = socket.socketpair()
    ours = MessageStream(await UNIXSocketStream.from_socket(a), max_frame_size=max_frame_size)
    async with ours.stream, await UNIXSocketStream.from_socket(b) as theirs:
        with anyio.fail_after(5):
            yield ours, theirs


@pytest.mark.anyio
async def test_stream_round_trip_then_clean_close() -> None:
    async with stream_pair(max_frame_size=64) as (ms, raw):
        with pytest.raises(FrameTooLargeError):  # refused before anything is written
            await ms.send(ErrorReply("big", "x" * 100))
        sent = [Hello(1, "engine", 2), ArrayProbe(np.ones((2, 2), np.float16), None, "x")]
        for msg in sent:
            await ms.send(msg)
        peer = MessageStream(raw)
        assert [plain(await peer.receive()) for _ in sent] == [plain(m) for m in sent]
        await ms.stream.send_eof()
        with pytest.raises(anyio.EndOfStream):
            await peer.receive()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("wire", "error", "match"),
    [
        (b"\x00\x00", TruncatedFrameError, "inside a frame header"),
        (HEADER.pack(10) + b"abc", TruncatedFrameError, "inside a frame of 10 bytes"),
        (HEADER.pack(1025), FrameTooLargeError, "1025 bytes; the maximum is 1024"),
        (b"GET / HTTP/1.1\r\n\r\n", FrameTooLargeError, "the maximum is 1024"),
        (encode_frame(b"\xc1\xc1"), MalformedMessageError, "not valid msgpack"),
    ],
)
async def test_stream_bad_bytes(wire: bytes, error: type[Exception], match: str) -> None:
    async with stream_pair() as (ms, raw):
        await raw.send(wire)
        await raw.send_eof()
        with pytest.raises(error, match=match):
            await ms.receive()


@pytest.mark.anyio
async def test_handshake() -> None:
    welcomes: list[Welcome] = []

    async def client(ms: MessageStream) -> None:
        welcomes.append(await client_handshake(ms, "engine"))

    async with stream_pair() as (ms, raw), anyio.create_task_group() as tg:
        tg.start_soon(client, ms)
        hello = await server_handshake(MessageStream(raw), "worker")
    assert (hello.protocol_version, hello.role) == (PROTOCOL_VERSION, "engine")
    assert (welcomes[0].protocol_version, welcomes[0].server) == (PROTOCOL_VERSION, "worker")


def assert_names_both_versions(text: str) -> None:
    assert f"version {PROTOCOL_VERSION}" in text and "version 999" in text, text


@pytest.mark.anyio
async def test_server_refuses_other_version_and_says_why() -> None:
    async with stream_pair() as (server, raw):
        client = MessageStream(raw)
        await client.send(Hello(999, "engine", 1))
        with pytest.raises(VersionMismatchError) as info:
            await server_handshake(server, "manager")
        assert_names_both_versions(str(info.value))
        assert await client.receive() == ErrorReply("version_mismatch", str(info.value))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "answer",
    [
        Welcome(999, "manager", 1),
        ErrorReply("version_mismatch", f"version 999 vs version {PROTOCOL_VERSION}"),
    ],
)
async def test_client_refuses_other_version(answer: Any) -> None:
    async with stream_pair() as (client, raw):
        await MessageStream(raw).send(answer)
        with pytest.raises(VersionMismatchError) as info:
            await client_handshake(client, "engine")
        assert_names_both_versions(str(info.value))


@pytest.mark.anyio
@pytest.mark.parametrize("first", [StatusRequest(), ErrorReply("no", "a client refuses nothing")])
async def test_server_wants_hello_first(first: Any) -> None:
    async with stream_pair() as (server, raw):
        await MessageStream(raw).send(first)
        expected = f"expected Hello, got {type(first).__name__}"
        with pytest.raises(UnexpectedMessageError, match=expected):
            await server_handshake(server, "manager")


def test_lease_tokens_stay_out_of_reprs() -> None:
    secret = b"\x01secret-token"
    for msg in [Lease(secret), Attach(secret)]:
        assert repr(secret) not in repr(msg) and "secret-token" not in repr(msg)
