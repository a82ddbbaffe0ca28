"""Attaching to acquired workers: a rank that hangs up or died since WorkersAcquired is a clear
error (ManagerError naming the socket; EngineDeadError with the manager's report of the death),
never a bare anyio exception; and the readers of an engine whose scope is cancelled end by
their connection closing. Every test runs on asyncio and trio."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
from pathlib import Path

import anyio
import pytest
from support.processes import wait_gone

from loomllm import Engine, EngineDeadError
from loomllm.clients.workers import WorkerClient
from loomllm.engine import replica as replica_module
from loomllm.errors import ManagerError
from loomllm.protocols.connection import MessageStream
from loomllm.protocols.messages import Ack

pytestmark = pytest.mark.anyio


async def test_a_rank_that_hangs_up_is_a_manager_error_naming_its_socket():
    async def hang_up(stream: anyio.abc.ByteStream) -> None:
        await stream.aclose()  # as a worker that dies as we connect

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        path = str(Path(tmp) / "rank0.sock")
        listener = await anyio.create_unix_listener(path)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, hang_up)
            with pytest.raises(ManagerError, match=f"could not attach to worker socket {path}: "):
                await WorkerClient.connect([path], b"lease")
            tg.cancel_scope.cancel()


async def test_a_cancelled_engine_scope_leaves_its_readers_to_end_by_the_close():
    """Data arrives in the very loop iteration in which the engine's scope is cancelled: a
    reader cancelled then failed a callback of anyio's asyncio Unix socket (InvalidStateError,
    which anyio's test runner raises here). Shielded, it reads on until aclose() shuts the
    connection, as the engine's exit does before its task group ends."""
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    client = WorkerClient([MessageStream(await anyio.abc.UNIXSocketStream.from_socket(ours))])
    lost: list[str] = []
    with theirs, anyio.CancelScope() as engine_scope:
        async with anyio.create_task_group() as tg:
            try:
                client.start_readers(tg, lambda rank, why: lost.append(why))
                await anyio.sleep(0.05)  # the reader waits for data
                theirs.sendall(client.ranks[0].frame(Ack()))  # readable from the next poll on
                await anyio.lowlevel.checkpoint()  # this task runs first in that iteration
                engine_scope.cancel()
                await anyio.sleep_forever()
            finally:
                await client.aclose()
    assert engine_scope.cancelled_caught
    assert lost == []  # closed by us: not a lost worker


async def test_worker_dying_before_attach_is_engine_dead_with_its_report(
    tiny_model, shared_manager, monkeypatch
):
    """The worker dies between the manager's WorkersAcquired and our Attach: the error is
    the manager's report (killed by SIGKILL), not the broken socket's empty message."""
    acquired_pids: list[int] = []
    acquire = replica_module.ManagerClient.acquire
    connect = WorkerClient.connect.__func__

    async def recording_acquire(self, *args, **kwargs):
        acquired = await acquire(self, *args, **kwargs)
        acquired_pids.extend(acquired.pids)
        return acquired

    async def kill_then_connect(cls, sockets, lease_token):
        os.kill(acquired_pids[0], signal.SIGKILL)
        return await connect(cls, sockets, lease_token)

    monkeypatch.setattr(replica_module.ManagerClient, "acquire", recording_acquire)
    monkeypatch.setattr(WorkerClient, "connect", classmethod(kill_then_connect))
    # A max_num_seqs of its own: a fresh worker, not a warm one other tests hold on to.
    with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
        with anyio.fail_after(60):
            async with Engine(tiny_model, manager_socket=shared_manager.socket, max_num_seqs=41):
                pass
    assert wait_gone(acquired_pids[0], timeout=10)
