"""A CPU worker beside busy processes: its OpenMP team shrinks while they hold the cores, and
its greedy tokens stay those of a worker alone, then and once they are gone
(device/cpu_threads.py); with LOOM_CPU_ADAPTIVE_THREADS=0 the team stays whole. That the team
grows back once a core is free is tests/workers/device/test_cpu_threads.py's, with readings
injected: here it would hang on whatever else holds the host's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from support.managers import new_manager_handle

from loomllm import Engine, SamplingParams
from loomllm.workers.device.cpu_threads import GOMP_SPIN_COUNT

# Busy processes on every core: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

CORES = len(os.sched_getaffinity(0))
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + k, 40 + 3 * k, 7] for k in range(8)]


async def team(engine: Engine) -> tuple[int, int] | None:
    """The worker's (threads, max_threads), or None without a governor. (A lambda: the worker
    cannot import this module, so the call goes by value.)"""
    [found] = await engine.collective_rpc(
        lambda w: (
            None if w.cpu_threads is None else (w.cpu_threads.threads, w.cpu_threads.max_threads)
        )
    )
    return found


async def tokens(engine: Engine) -> list[list[int]]:
    outputs: list[list[int]] = []
    for prompt in PROMPTS:
        async with engine.generate({"prompt_token_ids": prompt}, GREEDY) as stream:
            async for out in stream:
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
    return outputs


async def until_team(engine: Engine, threads: int, expected: list[list[int]]) -> None:
    """Generate (each round's tokens checked) until the worker's team has `threads`."""
    deadline = time.monotonic() + 120
    while (await team(engine))[0] != threads:
        assert time.monotonic() < deadline, f"the team never reached {threads} threads"
        assert await tokens(engine) == expected


def hogs() -> list[subprocess.Popen]:
    # Two busy processes a core, so that every thread of the worker waits its turn.
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * CORES)]


@pytest.mark.skipif(CORES < 2, reason="a team of one thread has nothing to shrink")
@pytest.mark.anyio
async def test_the_team_shrinks_beside_busy_processes_tokens_unchanged(tiny_model, manager):
    # int4 weights on the a8 kernel: tokens and logprobs that hold at any thread count
    # (float32 matmuls may move in their last bits).
    async with Engine(
        tiny_model,
        manager_socket=manager.socket,
        dtype="float32",
        quantization="int4",
        cpu_linear_kernel="a8",
    ) as engine:
        assert await team(engine) == (CORES, CORES)
        expected = await tokens(engine)
        busy = hogs()
        try:
            await until_team(engine, 1, expected)
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        assert await tokens(engine) == expected


@pytest.mark.anyio
async def test_turned_off_the_worker_keeps_torch_s_threads(tiny_model):
    handle = new_manager_handle(extra_env={"LOOM_CPU_ADAPTIVE_THREADS": "0"})
    try:
        handle.start()
        async with Engine(tiny_model, manager_socket=handle.socket, dtype="float32") as engine:
            assert await team(engine) is None
            threads = await engine.collective_rpc(lambda w: __import__("torch").get_num_threads())
            assert threads == [CORES]
            # The daemon gave its workers a short OpenMP spin, unless the tests' own
            # environment named one.
            spin = await engine.collective_rpc(lambda w: os.environ.get("GOMP_SPINCOUNT"))
            assert spin == [os.environ.get("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)]
    finally:
        handle.stop_and_check_clean()
