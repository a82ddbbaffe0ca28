"""Errors raised while framing, encoding or decoding what crosses a process boundary."""

from __future__ import annotations

# The exception tree:
# ProtocolError                 anything wrong with the bytes or messages a peer sent
# ├── FrameTooLargeError        a length prefix above the connection's max frame size
# ├── TruncatedFrameError       the stream ended in the middle of a frame
# ├── MalformedMessageError     a frame that is not a well-formed message
# │   └── UnknownMessageError   a well-formed body with a type code nobody registered
# ├── VersionMismatchError      HELLO/WELCOME carried another protocol_version
# ├── UnexpectedMessageError    a valid message at a point where another was expected
# └── SilentPeerError           a client that connected and did not open the conversation


class ProtocolError(Exception):
    """The peer broke the wire protocol; the connection cannot be trusted any more."""


class FrameTooLargeError(ProtocolError):
    """A frame's length prefix exceeds the connection's maximum frame size."""


class TruncatedFrameError(ProtocolError):
    """The byte stream ended before a whole frame arrived."""


class MalformedMessageError(ProtocolError):
    """A frame body that does not decode to a registered message."""


class UnknownMessageError(MalformedMessageError):
    """A frame body whose type code is not registered."""


class VersionMismatchError(ProtocolError):
    """The two sides speak different protocol versions."""


class UnexpectedMessageError(ProtocolError):
    """A message of the wrong type for this point of the conversation."""


class SilentPeerError(ProtocolError):
    """A client sent nothing (or not all of its first message) within the time allowed."""
