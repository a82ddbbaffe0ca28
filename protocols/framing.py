"""Length-prefixed frames: a 4-byte big-endian length, then that many body bytes.

No I/O: `encode_frame` builds a frame, `FrameReader` splits a byte stream back into bodies.
"""

from __future__ import annotations

import struct

from loomllm.protocols.errors import FrameTooLargeError, TruncatedFrameError

HEADER = struct.Struct(">I")
# 64 MiB is far above any step message or collective_rpc payload we expect, and far below
# what would let a hostile peer make us allocate the machine's memory.
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
# The opening messages (Hello, Attach) arrive before the peer has shown a secret: keep them tiny.
OPENING_MAX_FRAME_SIZE = 4096


def encode_frame(body: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Return `body` with its length prefix; refuse bodies the peer would refuse."""
    if len(body) > max_frame_size:
        raise FrameTooLargeError(
            f"frame of {len(body)} bytes exceeds the maximum frame size of {max_frame_size}"
        )
    return HEADER.pack(len(body)) + body


def check_frame_length(length: int, max_frame_size: int) -> None:
    """Raise FrameTooLargeError before anything is allocated for an oversized frame."""
    if length > max_frame_size:
        raise FrameTooLargeError(
            f"peer announced a frame of {length} bytes; the maximum is {max_frame_size}"
        )


class FrameReader:
    """Incremental frame splitter: `feed(data)` returns the bodies completed by `data`."""

    __slots__ = ("_buffer", "_max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._buffer = bytearray()
        self._max_frame_size = max_frame_size

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames: list[bytes] = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            check_frame_length(length, self._max_frame_size)
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append(bytes(self._buffer[HEADER.size : end]))
            del self._buffer[:end]
        return frames

    def close(self) -> None:
        """Call at end of stream: leftover bytes mean the peer stopped mid-frame."""
        if self._buffer:
            raise TruncatedFrameError(
                f"stream ended with {len(self._buffer)} bytes of an unfinished frame"
            )
