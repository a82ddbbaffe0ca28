"""Who is on the other end of a Unix socket (SO_PEERCRED), and the same-user rule.

The manager and the workers serve only their own user.
"""

from __future__ import annotations

import os
import socket
import struct

from anyio.abc import SocketAttribute, SocketStream

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(stream: SocketStream) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel saw it."""
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def is_unix(stream: SocketStream) -> bool:
    return stream.extra(SocketAttribute.family) == socket.AF_UNIX


def describe_peer(stream: SocketStream) -> str:
    """ "pid N" on a Unix socket, "host:port" over TCP: for the logs."""
    if is_unix(stream):
        return f"pid {peer_credentials(stream)[0]}"
    address = stream.extra(SocketAttribute.remote_address)
    assert isinstance(address, tuple)  # TCP: (host, port, ...)
    host, port = address[:2]
    return f"{host}:{port}"


def refusal(
    stream: SocketStream, allowed_uid: int | None = None, *, allow_tcp: bool = False
) -> str | None:
    """Why this peer may not talk to us, or None if it may.

    Over TCP (`allow_tcp`: a Ray rank's data port) there are no peer credentials: the lease
    token that Attach presents is the only key. Tests pass `allowed_uid` to play another user.
    """
    if not is_unix(stream):
        return None if allow_tcp else "this socket serves local (Unix socket) peers only"
    allowed = os.getuid() if allowed_uid is None else allowed_uid
    pid, uid, _ = peer_credentials(stream)
    if uid != allowed:
        return f"peer uid {uid} (pid {pid}) is not allowed: this socket serves uid {allowed} only"
    return None
