"""kill -9 of a worker, of the manager and of the user's process: nothing hangs, nothing leaks.

Each test has its own manager (they kill things), on asyncio and trio where async.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest
from proc_utils import is_alive, wait_gone

from runtime import Engine, EngineDeadError


def _block_in_worker(fifo: str) -> None:
    """Runs on the worker: say "in the call" through a FIFO, then block for a long time."""

    def fn(worker):
        with open(fifo, "w") as f:
            f.write("in\n")
        time.sleep(60)

    return fn


def _read_all(path: str) -> str:
    with open(path) as f:
        return f.read()


async def _wait_fifo(fifo: str) -> None:
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(_read_all, fifo)


@pytest.mark.anyio
async def test_kill_worker_mid_call_fails_fast_and_manager_survives(tiny_model, manager, tmp_path):
    manager.start()
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    elapsed = None
    with pytest.raises(EngineDeadError) as info:
        async with Engine(tiny_model, manager_socket=manager.socket) as engine:
            pid = engine.worker_pids[0]
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.collective_rpc, _block_in_worker(fifo))
                await _wait_fifo(fifo)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                await anyio.sleep_forever()  # the engine's death must end this, not a timeout
    elapsed = time.monotonic() - killed_at
    assert elapsed < 1.0, elapsed
    assert "SIGKILL" in str(info.value) and str(pid) in str(info.value)
    assert manager.cli("status").returncode == 0
    async with Engine(tiny_model, manager_socket=manager.socket) as engine:
        assert engine.worker_pids != [pid]
        assert await engine.collective_rpc(lambda w: "alive") == ["alive"]


@pytest.mark.anyio
async def test_worker_death_while_idle_ends_the_block(tiny_model, manager):
    manager.start()
    with pytest.raises(EngineDeadError, match="exited with code 3"):
        with anyio.fail_after(10):
            async with Engine(tiny_model, manager_socket=manager.socket) as engine:
                # Exits the worker from inside; the call itself never answers.
                engine_task = engine.collective_rpc(lambda w: os._exit(3))
                await engine_task


def test_kill_manager_takes_workers_down_and_next_engine_recovers(tiny_model, manager):
    manager.start()
    script = _attach_script(tiny_model, keep_alive=300, wait=False)
    out = subprocess.run([sys.executable, "-c", script], env=manager.env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    worker_pid = int(out.stdout.split()[0])
    assert is_alive(worker_pid)  # warm, idle
    os.kill(manager.pid(), signal.SIGKILL)
    assert wait_gone(worker_pid, timeout=5)
    # The stale socket file is still there; the next engine must replace it, not trust it.
    assert manager.socket.exists()
    again = subprocess.run([sys.executable, "-c", script], env=manager.env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert int(again.stdout.split()[0]) != worker_pid


@pytest.mark.parametrize("keep_alive", [300, 0])
def test_kill_user_process_returns_workers(tiny_model, manager, keep_alive):
    manager.start()
    user = subprocess.Popen(
        [sys.executable, "-c", _attach_script(tiny_model, keep_alive=keep_alive, wait=True)],
        env=manager.env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        worker_pid = int(user.stdout.readline().split()[0])  # attached, state set, now waiting
        assert manager.worker_states() == {worker_pid: "busy"}
        user.kill()
        user.wait()
    finally:
        user.stdout.close()
    if keep_alive == 0:
        assert wait_gone(worker_pid, timeout=10)
        return
    deadline = time.monotonic() + 5
    while manager.worker_states() != {worker_pid: "idle"}:
        assert time.monotonic() < deadline, manager.worker_states()
        time.sleep(0.05)
    # Warm, and nothing of the dead user's state survived.
    out = subprocess.run([sys.executable, "-c", _attach_script(tiny_model, 300, wait=False)],
                         env=manager.env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.split() == [str(worker_pid), "{}"], out.stderr


def _attach_script(model: str, keep_alive: float, wait: bool) -> str:
    """A user program: attach, print "<worker pid> <session before>", set state, maybe wait."""
    return textwrap.dedent(f"""
        import os, anyio
        from runtime import Engine
        async def main():
            async with Engine({model!r}, keep_alive={keep_alive}) as e:
                before = await e.collective_rpc(lambda w: dict(w.session))
                await e.collective_rpc(lambda w: w.session.update(user_pid=os.getpid()))
                print(e.worker_pids[0], before[0], flush=True)
                if {wait}:
                    await anyio.sleep_forever()
        anyio.run(main)
    """)
