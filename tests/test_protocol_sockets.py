"""Bad bytes at the real sockets: the manager and a worker refuse them and keep serving.

Raw connections send truncated frames, garbage, oversized headers, a foreign protocol
version or no HELLO; each gets an ErrorReply and a closed connection, and the daemon
and the worker go on serving their legitimate clients. Also SO_PEERCRED refusals.
One tiny worker, kept warm in the session's shared manager, serves the whole module.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import anyio
import cloudpickle
import msgpack
import pytest
from anyio.abc import UNIXSocketStream

from protocols.codec import encode
from protocols.connection import MessageStream, client_handshake, open_unix_connection
from protocols.framing import HEADER, encode_frame
from protocols.messages import (
    PROTOCOL_VERSION,
    AcquireWorkers,
    CallResult,
    ErrorReply,
    Hello,
    RunCallable,
    StatusRequest,
    WorkerSpec,
)
from runtime import Engine
from runtime.errors import ManagerError
from workers.peer_auth import peer_credentials, refusal

pytestmark = pytest.mark.anyio

ENGINE_START_S = 120  # the first Engine of the session loads a worker
REPLY_S = 10

# Bytes that break the framing or the codec: refused at any point of a conversation.
BROKEN = {
    "truncated": encode_frame(encode(Hello(1, "engine", 1)))[:-3],
    "http": b"GET / HTTP/1.1\r\nHost: loom\r\n\r\n",  # "GET " reads as a 1.2 GB length
    "oversized": HEADER.pack(2**32 - 1),
    "not_msgpack": encode_frame(b"\xc1" * 16),
    "unknown_type": encode_frame(msgpack.packb([9999, []])),
    "wrong_fields": encode_frame(msgpack.packb([1, ["one", "engine"]])),
}
# Valid frames that are wrong as the first message of a connection.
BAD_OPENING = {
    "version_mismatch": (encode_frame(encode(Hello(999, "engine", 1))), "version_mismatch"),
    "no_hello": (encode_frame(encode(StatusRequest())), "protocol_error"),
}
BEFORE_HELLO = {
    **{name: (wire, "protocol_error") for name, wire in BROKEN.items()},
    **BAD_OPENING,
}


async def answers_to(path: str | Path, wire: bytes, *, hello_first: bool = False) -> list[Any]:
    """Send `wire` on a fresh connection; return all the server says until it hangs up."""
    with anyio.fail_after(REPLY_S):
        async with await anyio.connect_unix(os.fspath(path)) as stream:
            ms = MessageStream(stream)
            if hello_first:
                await client_handshake(ms, "test")
            await stream.send(wire)
            await stream.send_eof()  # a truncated frame stays truncated
            answers = []
            while True:
                try:
                    answers.append(await ms.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return answers


def assert_refused(answers: list[Any], kind: str) -> None:
    assert answers, "the server hung up without an ErrorReply"
    assert all(isinstance(a, ErrorReply) for a in answers), answers
    assert answers[0].kind == kind, answers
    assert answers[0].message


async def assert_manager_serves(handle: Any, tiny_model: str) -> None:
    status = await anyio.to_thread.run_sync(handle.cli, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    with anyio.fail_after(ENGINE_START_S):
        async with Engine(tiny_model, manager_socket=handle.socket) as engine:
            assert await engine.collective_rpc(lambda w: 1) == [1]


# -- the manager ------------------------------------------------------------------------


@pytest.mark.parametrize(("wire", "kind"), BEFORE_HELLO.values(), ids=BEFORE_HELLO.keys())
async def test_manager_refuses_bad_opening(shared_manager, tiny_model, wire, kind) -> None:
    assert_refused(await answers_to(shared_manager.socket, wire), kind)
    await assert_manager_serves(shared_manager, tiny_model)


@pytest.mark.parametrize("wire", BROKEN.values(), ids=BROKEN.keys())
async def test_manager_refuses_bad_bytes_after_hello(shared_manager, tiny_model, wire) -> None:
    answers = await answers_to(shared_manager.socket, wire, hello_first=True)
    assert_refused(answers, "protocol_error")
    await assert_manager_serves(shared_manager, tiny_model)


async def test_version_mismatch_names_both_versions(shared_manager) -> None:
    wire, _ = BAD_OPENING["version_mismatch"]
    message = (await answers_to(shared_manager.socket, wire))[0].message
    assert f"version {PROTOCOL_VERSION}," in message and "version 999" in message


@pytest.mark.parametrize(
    "spec", [WorkerSpec("tiny\x00model"), WorkerSpec("tiny", 1, {"dtype": b"bytes"})],
    ids=["nul_in_model", "bytes_in_options"],
)  # fmt: skip
async def test_manager_survives_unlaunchable_acquire(manager, tiny_model, spec) -> None:
    await anyio.to_thread.run_sync(manager.start)
    with anyio.fail_after(REPLY_S):
        ms = await open_unix_connection(manager.socket, "engine")
        async with ms.stream:
            await ms.send(AcquireWorkers(spec, 0.0, "test"))
            reply = await ms.receive()
    assert isinstance(reply, ErrorReply), reply
    await assert_manager_serves(manager, tiny_model)


# -- a worker's data socket -------------------------------------------------------------


@pytest.mark.parametrize(("wire", "kind"), BEFORE_HELLO.values(), ids=BEFORE_HELLO.keys())
async def test_worker_refuses_bad_opening(shared_manager, tiny_model, wire, kind) -> None:
    with anyio.fail_after(ENGINE_START_S):
        async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
            # The engine is attached; a second connection's bad bytes must not disturb it.
            assert_refused(await answers_to(engine._acquired.sockets[0], wire), kind)
            assert await engine.collective_rpc(lambda w: 1) == [1]


async def test_worker_stays_warm_after_a_broken_session(shared_manager, tiny_model) -> None:
    with anyio.fail_after(ENGINE_START_S):
        async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
            path, pids = engine._acquired.sockets[0], engine.worker_pids
    # The worker is idle now: a raw client attaches, then breaks the protocol.
    answers = await answers_to(path, BROKEN["not_msgpack"], hello_first=True)
    assert_refused(answers, "protocol_error")
    # The same worker takes the next client (asked directly: the manager may hold others).
    with anyio.fail_after(REPLY_S):
        ms = await open_unix_connection(path, "engine")
        async with ms.stream:
            await ms.send(RunCallable(1, cloudpickle.dumps((lambda w: os.getpid(), (), {}))))
            reply = await ms.receive_type(CallResult)
    assert cloudpickle.loads(reply.payload) == pids[0]


# -- SO_PEERCRED ------------------------------------------------------------------------


async def start_refusing_manager(manager) -> int:
    """Start a manager that serves only another uid; return that uid."""
    other_uid = os.getuid() + 1
    await anyio.to_thread.run_sync(manager.start, "--allowed-uid", str(other_uid))
    return other_uid


def stop_refusing_manager(manager) -> None:
    # `engine-manager stop` cannot talk to it either: signal the daemon we started.
    for pid in manager.processes():
        os.kill(pid, signal.SIGTERM)


async def refusal_from(manager) -> ErrorReply:
    with anyio.fail_after(REPLY_S):
        async with await anyio.connect_unix(os.fspath(manager.socket)) as stream:
            return await MessageStream(stream).receive()


async def test_manager_refuses_other_uid(manager) -> None:
    other_uid = await start_refusing_manager(manager)
    try:
        for _ in range(2):  # the second connection proves the daemon is still there
            reply = await refusal_from(manager)
            assert reply.kind == "permission_denied"
            assert f"peer uid {os.getuid()} " in reply.message
            assert f"serves uid {other_uid} only" in reply.message
    finally:
        stop_refusing_manager(manager)


async def test_engine_refused_by_other_uid_raises_manager_error(manager, tiny_model) -> None:
    other_uid = await start_refusing_manager(manager)
    try:
        with anyio.fail_after(REPLY_S), pytest.raises(Exception) as info:
            async with Engine(tiny_model, manager_socket=manager.socket):
                pass
        assert (await refusal_from(manager)).kind == "permission_denied"  # still alive
        assert isinstance(info.value, ManagerError), repr(info.value)
        assert str(other_uid) in str(info.value)
    finally:
        stop_refusing_manager(manager)


async def test_refusal_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    async with await UNIXSocketStream.from_socket(a) as stream:
        with b:
            uid = os.getuid()
            assert peer_credentials(stream) == (os.getpid(), uid, os.getgid())
            assert refusal(stream) is None
            assert refusal(stream, allowed_uid=uid) is None
            why = refusal(stream, allowed_uid=uid + 1)
            assert why == (
                f"peer uid {uid} (pid {os.getpid()}) is not allowed: "
                f"this socket serves uid {uid + 1} only"
            )
