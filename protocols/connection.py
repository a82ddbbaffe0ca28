"""Typed messages over any anyio byte stream: framing, codec and the HELLO/WELCOME handshake.

Both ends of every connection (manager, worker, engine, CLI) talk through a MessageStream.
"""

from __future__ import annotations

import os
import socket
from typing import Any, TypeVar

import anyio
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from loomllm.protocols.codec import decode, encode
from loomllm.protocols.errors import (
    SilentPeerError,
    TruncatedFrameError,
    UnexpectedMessageError,
    VersionMismatchError,
)
from loomllm.protocols.framing import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER,
    check_frame_length,
    encode_frame,
)
from loomllm.protocols.messages import PROTOCOL_VERSION, ErrorReply, Hello, Welcome

M = TypeVar("M")
# A client that connects sends its opening messages at once; one that holds a connection
# without speaking would keep a task and an fd of the server's forever.
OPENING_TIMEOUT_S = 10.0


class MessageStream:
    """Send and receive whole messages; a lock keeps to one sender at a time.

    It owns no socket logic, so tests run it over in-memory streams too.
    """

    def __init__(self, stream: ByteStream, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._buffered = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()

    async def send(self, msg: Any) -> None:
        """Send one message.

        Cancellation: may leave a partial frame on the wire; close the stream after it.
        """
        await self.send_frame(self.frame(msg))

    async def send_if_open(self, msg: Any) -> None:
        """Send one message to a peer that may be gone already (a refusal, a last word):
        a closed or broken connection is not an error here."""
        try:
            await self.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    def frame(self, msg: Any) -> bytes:
        """Encode one message as a frame for `send_frame` (one encoding for many streams)."""
        return encode_frame(encode(msg), self.max_frame_size)

    async def send_frame(self, frame: bytes) -> None:
        """Send one frame made by `frame()`. Cancellation: as `send`."""
        async with self._send_lock:
            await self.stream.send(frame)

    async def receive(self) -> Any:
        """Receive one message; anyio.EndOfStream when the peer closed between frames.

        Cancellation: may consume part of a frame; close the stream after it.
        """
        try:
            header = await self._buffered.receive_exactly(HEADER.size)
        except anyio.IncompleteRead:
            if self._buffered.buffer:
                raise TruncatedFrameError("stream ended inside a frame header") from None
            raise anyio.EndOfStream from None
        (length,) = HEADER.unpack(header)
        check_frame_length(length, self.max_frame_size)
        try:
            body = await self._buffered.receive_exactly(length)
        except anyio.IncompleteRead:
            raise TruncatedFrameError(f"stream ended inside a frame of {length} bytes") from None
        return decode(body)

    async def receive_type(self, expected: type[M]) -> M:
        """Receive one message that must be `expected`; an ErrorReply becomes RemoteError."""
        msg = await self.receive()
        if isinstance(msg, expected):
            return msg
        if isinstance(msg, ErrorReply):
            raise RemoteError(msg.kind, msg.message)
        raise UnexpectedMessageError(f"expected {expected.__name__}, got {type(msg).__name__}")

    def shutdown(self) -> None:
        """Shut the socket both ways: a task blocked in receive() sees EOF and ends itself.

        Closing (or cancelling) a read instead races with data already in flight; anyio's
        asyncio Unix sockets then fail a callback with "invalid state".
        """
        sock = self.stream.extra(SocketAttribute.raw_socket, None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the socket is not connected any more

    async def aclose(self) -> None:
        await self.stream.aclose()


class RemoteError(Exception):
    """The peer answered with an ErrorReply; `kind` says which refusal it was."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


async def client_handshake(ms: MessageStream, role: str) -> Welcome:
    """Say HELLO, expect WELCOME with the same protocol version."""
    try:
        await ms.send(Hello(PROTOCOL_VERSION, role, os.getpid()))
    except (anyio.BrokenResourceError, OSError):
        pass  # a server that refused us at once has closed, but its reason is still readable
    try:
        welcome = await ms.receive_type(Welcome)
    except RemoteError as exc:
        if exc.kind == "version_mismatch":
            raise VersionMismatchError(exc.message) from None
        raise
    if welcome.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatchError(_mismatch(PROTOCOL_VERSION, welcome.protocol_version))
    return welcome


async def server_handshake(ms: MessageStream, server: str) -> Hello:
    """Expect HELLO; answer WELCOME, or an ErrorReply and VersionMismatchError."""
    hello = await receive_request(ms, Hello)
    if hello.protocol_version != PROTOCOL_VERSION:
        text = _mismatch(PROTOCOL_VERSION, hello.protocol_version, peer="client")
        await ms.send(ErrorReply("version_mismatch", text))
        raise VersionMismatchError(text)
    await ms.send(Welcome(PROTOCOL_VERSION, server, os.getpid()))
    return hello


async def receive_request(
    ms: MessageStream, expected: type[M], within: float = OPENING_TIMEOUT_S
) -> M:
    """Receive a client's opening message, which must be `expected`: anything else, an
    ErrorReply included (a client has nothing to refuse), is UnexpectedMessageError;
    nothing within `within` seconds is SilentPeerError."""
    msg = None
    with anyio.move_on_after(within):  # a frame cut off here is dropped with the connection
        msg = await ms.receive()
    if msg is None:  # only the timeout leaves msg None: receive() never returns None
        raise SilentPeerError(f"no {expected.__name__} within {within:g} s of connecting")
    if not isinstance(msg, expected):
        raise UnexpectedMessageError(f"expected {expected.__name__}, got {type(msg).__name__}")
    return msg


def _mismatch(ours: int, theirs: int, peer: str = "server") -> str:
    return (
        f"protocol version mismatch: this side speaks version {ours}, the {peer} "
        f"speaks version {theirs}; upgrade loomllm on both sides to the same release"
    )


TCP_SCHEME = "tcp://"


def tcp_address(host: str, port: int) -> str:
    """A worker's data address when it is reached over the network (a Ray rank)."""
    return f"{TCP_SCHEME}{host}:{port}"


async def open_connection(address: str, role: str) -> MessageStream:
    """Connect to a worker's data address, `tcp://host:port` or a Unix socket path, and
    complete the handshake."""
    if address.startswith(TCP_SCHEME):
        host, _, port = address[len(TCP_SCHEME) :].rpartition(":")
        stream: ByteStream = await anyio.connect_tcp(host, int(port))
        return await _handshake(MessageStream(stream), role)
    return await open_unix_connection(address, role)


async def open_unix_connection(path: str | os.PathLike[str], role: str) -> MessageStream:
    """Connect to a manager or worker socket and complete the handshake."""
    return await _handshake(MessageStream(await anyio.connect_unix(os.fspath(path))), role)


async def _handshake(ms: MessageStream, role: str) -> MessageStream:
    stream = ms.stream
    try:
        await client_handshake(ms, role)
    except BaseException:
        await anyio.aclose_forcefully(stream)
        raise
    return ms
