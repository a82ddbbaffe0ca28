"""Faults seen through the Python API, 10 trials each: a killed worker, a step that raises,
a KV cache too small for the load. Nothing hangs, every request ends exactly once. Then
two single cases: a worker killed inside a collective_rpc call, one that exits while idle.

The engines use the shared manager with options of their own (so no other test's warm
worker is touched); a killed worker's replacement is forked by the zygote in ~0.3 s.
"""

from __future__ import annotations

import os
import random
import signal
import time
from functools import partial

import anyio
import pytest
from support.worker_hooks import fail_next_launch

from loomllm import Engine, EngineDeadError
from loomllm.errors import EngineStepError
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

TRIALS = 10
DETECT_S = 1.0  # every in-flight stream ends within this after the fault
LONG = SamplingParams(
    max_tokens=400, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def consume(stream, seen: list[int], ends: list[tuple[str, float]], first) -> None:
    """Read a stream to its end; record how it ended and when. DELTA outputs: `seen` gets
    each token once, so a duplicate or a gap would show in its length."""
    try:
        async for out in stream:
            seen.extend(out.outputs[0].token_ids)
            first.set()
            if out.finished:
                ends.append(("finished", time.monotonic()))
                return
    except EngineDeadError:
        ends.append(("dead", time.monotonic()))
    except EngineStepError as exc:
        ends.append((f"step error: {exc}", time.monotonic()))


async def stream_until_flowing(tg, engine: Engine, prompts: list[str]):
    """Start a consumer per prompt (LONG requests) and return once each has a token:
    (tokens seen per stream, how and when each ended)."""
    seen: list[list[int]] = [[] for _ in prompts]
    ends: list[tuple[str, float]] = []
    firsts = [anyio.Event() for _ in prompts]
    for k, prompt in enumerate(prompts):
        tg.start_soon(consume, engine.generate(prompt, LONG), seen[k], ends, firsts[k])
    with anyio.fail_after(30):
        for first in firsts:
            await first.wait()
    return seen, ends


@pytest.mark.anyio
async def test_worker_killed_mid_stream_fails_every_stream_within_1s(
    tiny_model, shared_manager, fault_report, anyio_backend
):
    open_engine = partial(
        Engine, tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_num_seqs=13
    )

    async def own_engine(*, task_status) -> None:
        # The engine's owner, as a server's supervisor holds it: the streams are read by
        # other tasks, which must each see the death through their own stream.
        with pytest.raises(EngineDeadError):
            async with open_engine() as engine:
                task_status.started(engine)
                await anyio.sleep_forever()

    async def trial(_: int) -> float:
        async with anyio.create_task_group() as tg:
            engine = await tg.start(own_engine)
            pid = engine.worker_pids[0]
            seen, ends = await stream_until_flowing(tg, engine, [f"w{5 + k} w6" for k in range(3)])
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        assert [how for how, _ in ends] == ["dead"] * len(seen), ends  # each once, as failed
        assert all(0 < len(tokens) < LONG.max_tokens for tokens in seen)
        worst = max(at for _, at in ends) - killed_at
        assert worst < DETECT_S, worst
        return worst

    await fault_report.run_async(
        f"kill -9 worker mid-stream, Python ({anyio_backend})", TRIALS, trial
    )


@pytest.mark.anyio
async def test_step_that_raises_fails_its_requests_and_the_engine_serves_on(
    tiny_model, shared_manager, fault_report, anyio_backend
):
    async with Engine(
        tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_num_seqs=14
    ) as engine:

        async def trial(_: int) -> float:
            async with anyio.create_task_group() as tg:
                seen, ends = await stream_until_flowing(tg, engine, ["w5 w7", "w6 w7"])
                injected_at = time.monotonic()
                await engine.collective_rpc(fail_next_launch)
            assert [how for how, _ in ends] == [
                "step error: RuntimeError: injected fault in the forward pass"
            ] * len(seen), ends
            worst = max(at for _, at in ends) - injected_at
            assert worst < DETECT_S, worst
            # The engine lives: a new request runs to its end, and nothing is held.
            async with engine.generate("w9 w9", SHORT) as stream:
                final = [out async for out in stream][-1]
            assert len(final.outputs[0].token_ids) == SHORT.max_tokens
            await engine.wait_until_idle()
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
            return worst

        await fault_report.run_async(
            f"worker raises in the forward pass ({anyio_backend})", TRIALS, trial
        )


@pytest.mark.anyio
async def test_out_of_kv_blocks_preempts_and_every_request_finishes(
    tiny_model, shared_manager, fault_report, anyio_backend
):
    # 8 blocks of 16 tokens. Four 20-token prompts fill them all (2 blocks each); each
    # request then grows to 4 blocks, so the scheduler must preempt (and recompute) to
    # finish them all.
    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        kv_cache_memory=8 * 8192,
        max_model_len=112,
    ) as engine:
        assert engine.stats().num_total_blocks == 8

        async def run(prompt: str, max_tokens: int, done: list[int]) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async with engine.generate(prompt, params) as stream:
                final = [out async for out in stream][-1]
            assert final.outputs[0].finish_reason == "length"
            assert len(final.outputs[0].token_ids) == max_tokens
            done.append(1)

        async def trial(i: int) -> None:
            rng = random.Random(i)
            preempted_before = engine.stats().num_preemptions
            done: list[int] = []
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for _ in range(4):
                        prompt = " ".join(f"w{rng.randrange(3, 250)}" for _ in range(20))
                        tg.start_soon(run, prompt, rng.randrange(30, 44), done)
            assert len(done) == 4
            assert engine.stats().num_preemptions > preempted_before
            await engine.wait_until_idle()
            assert engine.stats().num_free_blocks == 8

        fault = f"out of KV blocks, 4 requests of 4 blocks in 8 ({anyio_backend})"
        await fault_report.run_async(fault, TRIALS, trial)


def _block_in_worker(fifo: str):
    """Runs on the worker: say "in the call" through a FIFO, then block for a long time."""

    def fn(worker):
        with open(fifo, "w") as f:
            f.write("in\n")
        time.sleep(60)

    return fn


def _read_all(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.anyio
async def test_worker_killed_inside_a_call_names_the_signal_and_the_next_engine_works(
    tiny_model, shared_manager, tmp_path
):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    open_engine = partial(
        Engine, tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_num_seqs=11
    )
    with pytest.raises(EngineDeadError) as info:
        async with open_engine() as engine:
            pid = engine.worker_pids[0]
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.collective_rpc, _block_in_worker(fifo))
                with anyio.fail_after(30):
                    await anyio.to_thread.run_sync(_read_all, fifo)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                await anyio.sleep_forever()  # the engine's death must end this, not a timeout
    assert time.monotonic() - killed_at < DETECT_S
    assert "SIGKILL" in str(info.value) and str(pid) in str(info.value)
    assert shared_manager.cli("status").returncode == 0
    async with open_engine() as engine:
        assert engine.worker_pids != [pid]
        assert await engine.collective_rpc(lambda w: "alive") == ["alive"]


@pytest.mark.anyio
async def test_worker_death_while_idle_ends_the_block(tiny_model, shared_manager):
    with pytest.raises(EngineDeadError, match="exited with code 3"):
        with anyio.fail_after(10):
            async with Engine(
                tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_num_seqs=10
            ) as engine:
                # Exits the worker from inside; the call itself never answers.
                await engine.collective_rpc(lambda w: os._exit(3))
