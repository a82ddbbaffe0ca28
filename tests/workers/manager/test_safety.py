"""What starting, asking and stopping an engine-manager must never do: delete a user's
file, chmod a user's directory, end a private engine for a read-only `ps`, fail an
engine that connects while the shared daemon is on its way out, or hang an engine on a
daemon that accepts and never answers.
"""

from __future__ import annotations

import os
import stat

import anyio
import pytest
from support.processes import is_alive, wait_gone

from loomllm import ManagerError
from loomllm.clients.manager import (
    PrivateManager,
    connect_manager,
    connect_shared_manager,
    manager_command,
)
from loomllm.protocols.messages import ManagerStatus, StatusRequest
from loomllm.protocols.rundir import ensure_private_dir, ensure_socket_dir

# -- the socket's directory and the socket path ---------------------------------------------


def test_socket_dir_is_made_private_but_an_existing_one_is_left_alone(tmp_path):
    made = tmp_path / "a" / "b"
    ensure_socket_dir(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o755)
    ensure_socket_dir(project)  # others may list it: the files in it are 0600
    assert stat.S_IMODE(project.stat().st_mode) == 0o755


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_socket_dir_that_others_can_write_is_refused_unchanged(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(PermissionError, match=f"{shared} .* is writable by other users"):
        ensure_socket_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == mode


def test_an_open_workers_dir_is_refused_unchanged(tmp_path):
    workers = tmp_path / "m.sock.workers"
    workers.mkdir()
    os.chmod(workers, 0o755)
    with pytest.raises(PermissionError, match=f"chmod 700 {workers}"):
        ensure_private_dir(workers)
    assert stat.S_IMODE(workers.stat().st_mode) == 0o755


def test_start_and_serve_refuse_a_socket_path_that_is_a_file(manager):
    manager.socket.write_text("user data\n")  # a typo in --socket, say
    for args in [("start",), ("serve", "--idle-timeout", "-1")]:
        result = manager.cli(*args)
        assert result.returncode == 1, result.stdout
        assert f"{manager.socket} exists and is not a socket" in result.stderr
        assert manager.socket.read_text() == "user data\n"


def test_start_refuses_a_directory_others_can_write(manager):
    os.chmod(manager.socket.parent, 0o777)
    result = manager.cli("start")
    assert result.returncode == 1
    assert "is writable by other users" in result.stderr, result.stderr
    assert stat.S_IMODE(manager.socket.parent.stat().st_mode) == 0o777
    assert not manager.socket.exists()


@pytest.mark.anyio
async def test_an_engine_refuses_a_socket_path_that_is_a_file(manager):
    manager.socket.write_text("user data\n")
    with pytest.raises(ManagerError, match="exists and is not a socket"):
        await connect_shared_manager(manager.socket)
    assert manager.socket.read_text() == "user data\n"


# -- a private manager serves one engine ------------------------------------------------------


async def _cli(socket, *args: str) -> str:
    result = await anyio.run_process(manager_command(socket, *args), check=False)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


async def _status(ms) -> ManagerStatus:
    await ms.send(StatusRequest())
    return await ms.receive_type(ManagerStatus)


@pytest.mark.anyio
async def test_ps_and_status_do_not_end_a_private_manager():
    async with PrivateManager() as private:
        engine = await connect_manager(private.socket_path)
        async with engine.stream:
            pid = (await _status(engine)).pid
            assert "GROUP" in await _cli(private.socket_path, "ps")
            assert f"pid {pid}," in await _cli(private.socket_path, "status")
            with anyio.fail_after(10):
                # Until the manager has seen both CLI calls go (no sleeping): each left
                # it serving, and it still answers its engine.
                while (await _status(engine)).num_clients != 1:
                    pass
            assert (await _status(engine)).pid == pid and is_alive(pid)
        # Its engine gone, it exits by itself.
        assert wait_gone(pid, timeout=10)


# -- connecting while the shared daemon goes away ---------------------------------------------


async def _hang_up_once(listener) -> None:
    """Play a daemon that is exiting: accept one client, stop listening, hang up."""
    stream = await listener.accept()
    await listener.aclose()  # the socket file stays, as a real daemon's does for a while
    await stream.aclose()


@pytest.mark.anyio
async def test_an_engine_connecting_as_the_daemon_exits_starts_a_new_one(manager):
    listener = await anyio.create_unix_listener(manager.socket)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_hang_up_once, listener)
        with anyio.fail_after(60):
            ms = await connect_shared_manager(manager.socket)
    async with ms.stream:
        status = await _status(ms)
    assert status.socket == str(manager.socket) and is_alive(status.pid)


@pytest.mark.anyio
async def test_a_silent_daemon_is_an_error_not_a_hang(manager, monkeypatch):
    """A stopped (SIGSTOP) or hung daemon: its socket still accepts, into the kernel's
    backlog, and never answers Hello. The engine's start hung forever on it."""
    import socket

    from loomllm import Engine

    monkeypatch.setattr("loomllm.clients.manager.HANDSHAKE_TIMEOUT_S", 0.5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(manager.socket))
    silent.listen(8)  # never accepted, never answered
    try:
        with anyio.fail_after(30):
            for connect in (connect_manager, connect_shared_manager):
                with pytest.raises(ManagerError, match="did not answer in 0.5s"):
                    await connect(manager.socket)
            with pytest.raises(ManagerError, match="stopped or hung"):
                async with Engine("smollm2", manager_socket=manager.socket):
                    pass
    finally:
        silent.close()
        manager.socket.unlink()
