"""Engine shell against real managers and workers on CPU: attach, reuse, release, RPC, TP.

Uses a tiny random Llama, so a worker starts in a few seconds; every test runs on
asyncio and trio.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import anyio
import pytest
from support.processes import wait_gone

from loomllm import Engine, EngineClosedError, RemoteCallError, WorkerStartError
from loomllm.engine import engine as engine_module

pytestmark = pytest.mark.anyio


def open_socket_fds() -> set[str]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            fds.add(target)
    return fds


def our_threads() -> set[threading.Thread]:
    # anyio's pytest runner drives trio in guest mode, which polls I/O from "Trio thread"s.
    return {t for t in threading.enumerate() if not t.name.startswith("Trio thread")}


async def test_collective_rpc_and_clean_exit(tiny_model, shared_manager):
    sockets_before, threads_before = open_socket_fds(), our_threads()
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
        results = await engine.collective_rpc(lambda w, x, *, y: (w.rank, x + y), 2, y=3)
        assert results == [(0, 5)]
        assert engine.model_info.vocab_size == 256
        assert engine.model_info.num_kv_heads == 2
    # Leaving the block leaves no socket and no thread behind (tasks: the block returned).
    assert open_socket_fds() <= sockets_before
    assert our_threads() <= threads_before


async def test_second_engine_reuses_warm_workers(tiny_model, shared_manager):
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as first:
        pid, loaded_at = (await first.collective_rpc(lambda w: (os.getpid(), w.loaded_at)))[0]
        await first.collective_rpc(lambda w: w.session.update(secret=1))
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as second:
        assert second.reused_warm_workers
        again = await second.collective_rpc(lambda w: (os.getpid(), w.loaded_at, dict(w.session)))
        # Same process, same load (not reloaded), and the first engine's state is gone.
        assert again == [(pid, loaded_at, {})]


async def test_each_engine_with_a_seed_samples_as_on_new_workers(tiny_model, shared_manager):
    """`seed` seeds what unseeded requests draw from: a second engine on the warm workers
    samples what the first did, not where the first left the generator."""
    from loomllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        async with Engine(
            tiny_model, manager_socket=shared_manager.socket, seed=1234, max_num_seqs=43
        ) as engine:  # max_num_seqs: workers of its own
            runs.append(
                (
                    engine.reused_warm_workers,
                    [
                        [
                            out
                            async for out in engine.generate({"prompt_token_ids": [5, 6]}, params)
                        ][-1]
                        .outputs[0]
                        .token_ids
                        for _ in range(2)
                    ],
                )
            )
    (first_reused, first), (second_reused, second) = runs
    assert second_reused and first == second, runs
    assert first[0] != first[1]  # the generator moved on between requests: not re-seeded


async def test_engines_with_other_configs_do_not_share(tiny_model, shared_manager):
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as a:
        async with Engine(tiny_model, manager_socket=shared_manager.socket) as b:
            # Both exist at once: the second cannot take the busy workers.
            assert set(a.worker_pids).isdisjoint(b.worker_pids)


async def test_running_engines_freeze_the_heap(tiny_model, shared_manager, monkeypatch):
    """While an engine runs, what the process held at its start is out of gc's full
    collections (engine.py _freeze_heap); the last engine's exit unfreezes it."""
    gc.unfreeze()
    monkeypatch.setattr(engine_module, "_engines_frozen", 0)  # whatever ran before
    async with Engine(tiny_model, manager_socket=shared_manager.socket):
        assert gc.get_freeze_count() > 0
        async with Engine(tiny_model, manager_socket=shared_manager.socket):
            pass
        assert gc.get_freeze_count() > 0  # one engine still runs
    assert gc.get_freeze_count() == 0
    with pytest.raises(WorkerStartError, match="no-such-model"):  # freezes nothing
        async with Engine("no-such-model", manager_socket=shared_manager.socket):
            pass
    assert gc.get_freeze_count() == 0 and engine_module._engines_frozen == 0


async def test_remote_exception_keeps_engine_usable(tiny_model, shared_manager):
    def boom(worker):
        raise KeyError("no such thing")

    async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
        with pytest.raises(RemoteCallError, match="rank 0: KeyError") as info:
            await engine.collective_rpc(boom)
        assert "boom" in info.value.remote_traceback
        assert await engine.collective_rpc(lambda w: "still fine") == ["still fine"]


async def test_cancelled_call_does_not_confuse_the_next(tiny_model, shared_manager):
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
        with anyio.move_on_after(0.2):
            await engine.collective_rpc(lambda w: __import__("time").sleep(1) or "slow")
        assert await engine.collective_rpc(lambda w: "fast") == ["fast"]


async def test_use_outside_the_block_is_a_clear_error(tiny_model):
    engine = Engine(tiny_model)
    with pytest.raises(EngineClosedError, match="async with"):
        await engine.collective_rpc(lambda w: 1)


async def test_bad_options_fail_before_anything_starts():
    with pytest.raises(ValueError, match="dtype"):
        Engine("smollm2", dtype="int3")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Engine("smollm2", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="keep_alive must be seconds >= 0, or -1"):
        Engine("smollm2", keep_alive=-5)
    assert Engine("smollm2", keep_alive=float("inf")).config.keep_alive == -1  # pinned
    with pytest.raises(ValueError, match="manager"):
        Engine("smollm2", manager="remote")


async def test_a_relative_model_path_is_this_process_s(tiny_model, shared_manager, monkeypatch):
    """The workers resolve the model in the manager daemon's directory: a relative path
    of the user's is sent absolute, else it named another file there, or none."""
    from pathlib import Path

    model = Path(tiny_model)
    monkeypatch.chdir(model.parent)
    assert Path.cwd() != Path(shared_manager.socket).parent  # not the daemon's directory
    async with Engine(model.name, manager_socket=shared_manager.socket) as engine:
        assert engine.model_info.model_dir == str(model)  # (tiny_model is absolute)
    assert Engine("smollm2").config.model == "smollm2"  # an alias stays a name


async def test_unknown_model_is_a_clear_error_and_manager_survives(tiny_model, shared_manager):
    with pytest.raises(WorkerStartError, match="no-such-model"):
        async with Engine("/nonexistent/no-such-model", manager_socket=shared_manager.socket):
            pass
    assert shared_manager.cli("status").returncode == 0
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as engine:
        assert await engine.collective_rpc(lambda w: 1) == [1]


LEAVE_MID_STEP = """
import sys, anyio
from loomllm import Engine, SamplingParams

def slow_steps(w):
    import time
    launch = w.runner.launch
    w.runner.launch = lambda *a: (time.sleep(0.3), launch(*a))[1]

async def main():
    async with Engine(sys.argv[1], manager="private", keep_alive=0) as engine:
        await engine.collective_rpc(slow_steps)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]},
                                       SamplingParams(max_tokens=1)):
            pass
    print("left cleanly")

anyio.run(main, backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_leaving_right_after_the_last_output_is_clean(tiny_model, backend):
    """The user leaves the block as the engine starts the step that tells the worker about
    the finished request: that step must be cancelled, not sent on a closing socket and
    reported as a dead worker out of `__aexit__`. A plain script, not a test task: the
    race needs the ordinary event loop's scheduling (seen in a script on both backends)."""
    done = subprocess.run(
        [sys.executable, "-c", LEAVE_MID_STEP, tiny_model, backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "left cleanly" in done.stdout, done.stderr[-3000:]
    assert "could not release" not in done.stderr


async def test_leaving_by_cancellation_still_releases_politely(tiny_model, shared_manager, caplog):
    """A scope cancelled inside the block: the release still gets its answer, so a
    keep_alive=0 worker is gone on return, as after a normal exit."""
    with anyio.CancelScope() as scope:
        async with Engine(tiny_model, manager_socket=shared_manager.socket, keep_alive=0) as e:
            worker_pid = e.worker_pids[0]
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert wait_gone(worker_pid, timeout=0)
    assert "could not release" not in caplog.text


async def test_set_keep_alive_overrides_the_config_at_release(tiny_model, shared_manager):
    """A server unloading a model sets 0: its workers are gone when the engine has closed,
    though the engine was opened to keep them warm; the other way round they stay."""
    options = {"manager_socket": shared_manager.socket, "seed": 31}  # workers of its own
    async with Engine(tiny_model, **options, keep_alive=300) as engine:
        worker_pid = engine.worker_pids[0]
        engine.set_keep_alive(0)
    assert wait_gone(worker_pid, timeout=0)
    async with Engine(tiny_model, **options, keep_alive=0) as engine:
        worker_pid = engine.worker_pids[0]
        engine.set_keep_alive(60)
    async with Engine(tiny_model, **options, keep_alive=0) as engine:
        assert engine.worker_pids[0] == worker_pid  # still warm, and reused
        with pytest.raises(ValueError, match="keep_alive must be seconds >= 0, or -1"):
            engine.set_keep_alive(-3)
        with pytest.raises(TypeError, match="keep_alive must be a number"):
            engine.set_keep_alive("5m")  # type: ignore[arg-type]
    assert wait_gone(worker_pid, timeout=0)


async def test_private_manager_exits_with_the_engine(tiny_model):
    async with Engine(tiny_model, manager="private") as engine:
        worker_pid = engine.worker_pids[0]
        assert await engine.collective_rpc(lambda w: os.getpid()) == [worker_pid]
    # The private manager stops its workers on the way out.
    assert wait_gone(worker_pid, timeout=0)


@pytest.mark.serial  # two ranks, each wanting a core
async def test_two_ranks_form_a_process_group(tiny_model, manager):
    def all_reduce(worker):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(worker.rank + 1)])
        dist.all_reduce(t)
        return dist.get_backend(), dist.get_world_size(), t.item()

    async with Engine(tiny_model, tensor_parallel_size=2, manager_socket=manager.socket) as e:
        assert len(e.worker_pids) == 2
        assert await e.collective_rpc(all_reduce) == [("gloo", 2, 3.0), ("gloo", 2, 3.0)]
