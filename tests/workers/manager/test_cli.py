"""The `engine-manager` daemon through its command line: start, serve, stop, status, ps, logs,
unload, and its caps (max-workers, max-keep-alive, idle-timeout) seen from real engines.

Every test has its own manager on a temporary socket. Worker starts are the expensive
part (seconds of CPU each), so one test often checks several things about one worker.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import anyio
import pytest
from support.managers import pids_mentioning
from support.processes import is_alive, wait_gone

from loomllm import Engine, ManagerError, WorkerStartError
from loomllm.workers.manager import cli as manager_cli

STARTUP_TIMEOUT_S = 30


def _daemon_pids(manager) -> list[int]:
    """pids of `loomllm.workers.manager` processes (not workers, not CLI calls) on this socket."""
    pids = []
    for pid in pids_mentioning(str(manager.socket)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"loomllm.workers.manager" in argv:
            pids.append(pid)
    return pids


def _ps(manager) -> list[dict[str, str]]:
    """`engine-manager ps` parsed: one dict per worker row, keyed by the header's names."""
    result = manager.cli("ps")
    assert result.returncode == 0, result.stderr + result.stdout
    header, *lines = result.stdout.splitlines()
    names = header.split()
    assert names == [
        "GROUP",
        "RANK",
        "PID",
        "MODEL",
        "STATE",
        "MEMORY",
        "AGE",
        "KEEP_ALIVE",
        "EXPIRES",
    ]
    rows = []
    for line in lines:
        cells = line.split()
        assert cells[6] == "MiB", line  # MEMORY is "<n> MiB": two words
        cells[5:7] = [f"{cells[5]} MiB"]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


async def _attach_and_release(model: str, socket, **options) -> int:
    """Open an engine, check it answers, close it; return its worker's pid."""
    async with Engine(model, manager_socket=socket, **options) as engine:
        assert await engine.collective_rpc(lambda w: "ok") == ["ok"]
        return engine.worker_pids[0]


# -- no engine: the daemon by itself ---------------------------------------------------------


def test_client_commands_on_a_stopped_daemon(manager):
    status = manager.cli("status")
    assert status.returncode == 1
    assert "not running" in status.stdout and str(manager.socket) in status.stdout
    for args in [("ps",), ("unload", "some-model")]:
        result = manager.cli(*args)
        assert (result.returncode, result.stdout.strip()) == (1, "engine-manager is not running")
    stop = manager.cli("stop")
    assert (stop.returncode, stop.stdout.strip()) == (0, "engine-manager is not running")
    assert not manager.socket.exists()


SECONDS_OR_MINUS_ONE = "must be seconds >= 0 (finite), or -1"


@pytest.mark.parametrize("command", ["start", "serve"])
@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-workers", "0", "must be an integer >= 1, got 0"),
        ("--max-workers", "-1", "must be an integer >= 1, got -1"),
        ("--idle-timeout", "nan", f"{SECONDS_OR_MINUS_ONE}; got nan"),
        ("--idle-timeout", "-7", f"{SECONDS_OR_MINUS_ONE}; got -7"),
        ("--max-keep-alive", "-5", f"{SECONDS_OR_MINUS_ONE}; got -5"),
        ("--max-keep-alive", "inf", f"{SECONDS_OR_MINUS_ONE}; got inf"),
        (
            "--log-level",
            "foo",
            "invalid choice: 'FOO' (choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_flag(command, flag, value, message, capsys):
    # The parser, not main(): were a value accepted, `serve` would run the daemon here.
    with pytest.raises(SystemExit) as exited:
        manager_cli._parser().parse_args([command, flag, value])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == f"engine-manager {command}: error: argument {flag}: {message}"


def test_start_with_a_bad_value_spawns_no_daemon(manager):
    start = manager.cli("start", "--max-workers", "0")
    assert start.returncode == 2
    assert start.stderr.splitlines()[-1] == (
        "engine-manager start: error: argument --max-workers: must be an integer >= 1, got 0"
    )
    assert not manager.socket.exists() and not _daemon_pids(manager)


def test_documented_values_are_accepted():
    args = manager_cli._parser().parse_args(
        [
            "start",
            "--max-workers",
            "1",
            "--idle-timeout",
            "-1",
            "--max-keep-alive",
            "0",
            "--log-level",
            "debug",
        ]
    )
    assert (args.max_workers, args.idle_timeout, args.max_keep_alive, args.log_level) == (
        1,
        -1.0,
        0.0,
        "DEBUG",
    )


def test_running_daemon_status_logs_and_permissions(manager):
    # A directory others can list is the user's to set: left as it is; what goes in it
    # is private by itself.
    os.chmod(manager.socket.parent, 0o755)
    manager.start()
    [pid] = _daemon_pids(manager)
    status = manager.cli("status")
    assert status.returncode == 0, status.stderr
    assert f"pid {pid}," in status.stdout and f"socket {manager.socket}" in status.stdout
    logs = manager.cli("logs")
    assert logs.returncode == 0
    assert f"engine-manager pid {pid} listening on {manager.socket}" in logs.stdout
    socket_mode = os.stat(manager.socket).st_mode
    assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600
    assert stat.S_IMODE(os.stat(manager.socket.parent).st_mode) == 0o755
    for name in ["m.sock.log", "m.sock.lock"]:
        assert stat.S_IMODE(os.stat(manager.socket.parent / name).st_mode) == 0o600, name
    workers_dir = manager.socket.with_name(manager.socket.name + ".workers")
    assert stat.S_IMODE(os.stat(workers_dir).st_mode) == 0o700


def test_two_starts_at_once_make_one_daemon(manager):
    command = [sys.executable, "-m", "loomllm.workers.manager", "start"]
    starters = [
        subprocess.Popen(command, env=manager.env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=STARTUP_TIMEOUT_S)[0] for p in starters]
    assert [p.returncode for p in starters] == [0, 0], outputs
    assert sorted(out.split(" on ")[0] for out in outputs) == [
        "engine-manager already running",
        "engine-manager started",
    ]
    assert len(_daemon_pids(manager)) == 1
    assert manager.cli("status").returncode == 0


def test_serve_refuses_a_socket_that_is_served(manager):
    manager.start()
    pid = manager.pid()
    second = manager.cli("serve", "--idle-timeout", "-1")
    assert second.returncode != 0
    assert f"an engine-manager already serves {manager.socket}" in second.stderr
    # Untouched: same daemon, same socket file, still answering.
    assert manager.socket.exists() and manager.pid() == pid
    assert _daemon_pids(manager) == [pid]


def test_idle_timeout_exits_and_removes_the_socket(manager):
    manager.start("--idle-timeout", "1")
    [pid] = _daemon_pids(manager)  # from /proc: a client would reset the idle timer
    assert wait_gone(pid, timeout=10)
    assert not manager.socket.exists()
    assert "no clients and no workers for 1s: exiting" in manager.cli("logs").stdout


# -- with engines ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_ps_shows_busy_then_idle_and_unload_stops_the_idle_worker(tiny_model, manager):
    manager.start()
    async with Engine(tiny_model, manager_socket=manager.socket, keep_alive=300) as engine:
        worker_pid = engine.worker_pids[0]
        [row] = _ps(manager)
        assert row["PID"] == str(worker_pid) and row["MODEL"] == tiny_model
        assert (row["STATE"], row["KEEP_ALIVE"], row["EXPIRES"]) == ("busy", "300s", "-")
        assert int(row["MEMORY"].removesuffix(" MiB")) > 0
    [row] = _ps(manager)
    assert (row["PID"], row["STATE"], row["KEEP_ALIVE"]) == (str(worker_pid), "idle", "300s")
    assert 290 <= int(row["EXPIRES"].removesuffix("s")) <= 300
    unload = manager.cli("unload", tiny_model)
    assert unload.returncode == 0, unload.stderr
    assert unload.stdout.strip() == f"unloaded {tiny_model}: 1 worker(s)"
    assert wait_gone(worker_pid, timeout=10)
    assert _ps(manager) == []
    assert manager.cli("status").returncode == 0  # the daemon stays


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_keep_alive_zero_worker_exits_with_the_engine(tiny_model, manager):
    manager.start()
    worker_pid = await _attach_and_release(tiny_model, manager.socket, keep_alive=0)
    assert wait_gone(worker_pid, timeout=10)
    assert _ps(manager) == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_max_keep_alive_caps_pinned_and_short_keep_alive_expires(tiny_model, manager):
    manager.start("--max-keep-alive", "5")
    async with Engine(tiny_model, manager_socket=manager.socket, keep_alive=-1) as engine:
        worker_pid = engine.worker_pids[0]
        [row] = _ps(manager)
        assert (row["STATE"], row["KEEP_ALIVE"]) == ("busy", "5s")  # the cap wins over -1
    # The same warm worker, now with keep_alive=1 (under the cap): gone 1 s after release.
    async with Engine(tiny_model, manager_socket=manager.socket, keep_alive=1) as engine:
        assert engine.reused_warm_workers and engine.worker_pids == [worker_pid]
    released_at = time.monotonic()
    assert is_alive(worker_pid)
    assert wait_gone(worker_pid, timeout=10)
    assert time.monotonic() - released_at > 0.5  # its keep_alive ran out; not at release
    assert _ps(manager) == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_max_workers_refuses_then_evicts_idle_and_stop_stops_workers(tiny_model, manager):
    manager.start("--max-workers", "1")
    async with Engine(tiny_model, manager_socket=manager.socket) as first:
        first_pid = first.worker_pids[0]
        with pytest.raises(ManagerError, match="max-workers is 1") as info:
            async with Engine(tiny_model, manager_socket=manager.socket, dtype="bfloat16"):
                pass
        assert not isinstance(info.value, WorkerStartError)
        assert await first.collective_rpc(lambda w: "still here") == ["still here"]
    # The first worker is idle now: the other config's engine evicts it.
    async with Engine(tiny_model, manager_socket=manager.socket, dtype="bfloat16") as second:
        second_pid = second.worker_pids[0]
        assert second_pid != first_pid and second.model_info.dtype == "bfloat16"
        assert wait_gone(first_pid, timeout=10)
        [row] = _ps(manager)
        assert (row["PID"], row["STATE"]) == (str(second_pid), "busy")
    assert is_alive(second_pid)  # idle, warm
    stop = manager.cli("stop")
    assert (stop.returncode, stop.stdout.strip()) == (0, "engine-manager stopped")
    assert wait_gone(second_pid, timeout=10)
    assert not manager.socket.exists()
    assert manager.cli("status").returncode == 1


def test_sigterm_stops_workers_and_exits_zero(tiny_model, manager, tmp_path):
    read_end, write_end = os.pipe()
    command = [
        sys.executable,
        "-m",
        "loomllm.workers.manager",
        "--socket",
        str(manager.socket),
        "serve",
        "--idle-timeout",
        "-1",
        "--ready-fd",
        str(write_end),
    ]
    with open(tmp_path / "serve.log", "wb") as log:
        daemon = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(write_end,)
        )
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as ready:
            assert ready.readline() == b"ready\n", (tmp_path / "serve.log").read_text()
        assert f"pid {daemon.pid}," in manager.cli("status").stdout
        worker_pid = anyio.run(_attach_and_release, tiny_model, manager.socket)
        assert [row["STATE"] for row in _ps(manager)] == ["idle"]
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=STARTUP_TIMEOUT_S) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert wait_gone(worker_pid, timeout=0)
    assert not manager.socket.exists()
    assert "got SIGTERM: stopping workers and exiting" in (tmp_path / "serve.log").read_text()
