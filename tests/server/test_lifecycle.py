"""The server's engine lifecycle: restart after a worker's death, exit 1 when it cannot,
drain on SIGTERM (in-flight requests finish, or end with finish_reason "abort" after the
grace period), exit 0. In-process on both anyio backends, plus real `loom serve` processes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import partial

import anyio
import httpx
import pytest
from support.servers import loom_serve

from loomllm import Engine
from loomllm.errors import EngineDeadError
from loomllm.protocols.sampling import SamplingParams
from loomllm.server.fleet.supervisor import EngineSlot, drain, supervise
from loomllm.server.openai.schemas import ApiError

LONG = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True)  # outlives each test
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def opener(model: str, manager, **options) -> partial[Engine]:
    """Engines like the other tests' (so the shared manager's warm workers are reused)."""
    return partial(Engine, model, manager_socket=manager.socket, dtype="float32", **options)


async def wait_for(predicate) -> None:
    """Poll: the conditions here change inside other tasks' engine code, not on an Event."""
    with anyio.fail_after(30):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_supervisor_restarts_an_engine_whose_worker_died(tiny_model, shared_manager):
    slot = EngineSlot()
    async with anyio.create_task_group() as tg:
        # Options of its own: the worker it kills is no other test's warm one.
        open_engine = opener(tiny_model, shared_manager, max_num_seqs=12)
        await tg.start(partial(supervise, open_engine, slot))
        first = slot.engine
        assert first is not None
        with pytest.raises(EngineDeadError):
            async with first.generate("w5 w6", LONG) as stream:
                async for _ in stream:
                    os.kill(first.worker_pids[0], signal.SIGKILL)
        if slot.engine is None:  # between engines: 503, not a hang
            with pytest.raises(ApiError) as refused:
                slot.require()
            assert refused.value.status == 503 and "restarting" in refused.value.message
        await wait_for(lambda: slot.engine is not None and slot.engine is not first)
        async with slot.engine.generate("w5 w6", SHORT) as stream:
            final = [out async for out in stream][-1]
        assert len(final.outputs[0].token_ids) == 4
        assert slot.restarts == 1 and slot.failure is None and not slot.failed.is_set()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("grace", [0.0, 60.0])
async def test_drain_lets_requests_finish_within_grace_then_aborts(
    tiny_model, shared_manager, grace
):
    """grace 60: every request runs to its end; grace 0: each stops with "abort" at once."""
    async with opener(tiny_model, shared_manager)() as engine:
        slot = EngineSlot(engine)
        finals: dict[int, object] = {}

        async def run(i: int, params: SamplingParams) -> None:
            async with engine.generate("w5 w6", params) as stream:
                async for out in stream:
                    finals[i] = out

        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i, params)
            await wait_for(lambda: len(finals) == 4)  # all have begun
            await drain(slot, grace_s=grace)
        for out in finals.values():
            assert out.finished
            c = out.outputs[0]
            if grace:
                assert c.finish_reason == "length" and len(c.token_ids) == 40
            else:
                assert c.finish_reason == "abort" and len(c.token_ids) < 40
        with pytest.raises(ApiError) as refused:
            slot.require()
        assert refused.value.status == 503 and "shutting down" in refused.value.message
        await engine.wait_until_idle()
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks


def stream_completion(base: str, max_tokens: int, events: list) -> None:
    body = {
        "model": "tiny",
        "prompt": "w5 w6",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))


def finish_reasons(events: list) -> list:
    return [
        c["finish_reason"]
        for e in events
        if e != "[DONE]" and "choices" in e
        for c in e["choices"]
        if c["finish_reason"] is not None
    ]


def test_sigterm_under_load_drains_then_exits_0(tiny_model, shared_manager):
    """In-flight streams run to their end within the grace period; new connections fail."""
    with loom_serve(
        tiny_model, shared_manager.socket, "tiny", "asyncio", "--shutdown-grace", "60"
    ) as server:
        streams: list[list] = [[] for _ in range(5)]
        threads = [
            threading.Thread(target=stream_completion, args=(server.base_url, 200, s))
            for s in streams
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(streams):  # every stream has begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # it stops listening (while the streams go on)
            try:
                httpx.get(f"{server.base_url}/version", timeout=5)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "still accepting after SIGTERM"
            time.sleep(0.05)
        assert not all(finish_reasons(events) for events in streams)
        for t in threads:
            t.join(timeout=60)
        assert server.proc.wait(timeout=30) == 0, server.output()
    for events in streams:
        assert finish_reasons(events) == ["length"] and events[-1] == "[DONE]"
        assert (
            sum(len(c["text"].split()) for e in events if e != "[DONE]" for c in e["choices"])
            == 200
        )


def test_engine_death_without_restart_exits_1(tiny_model, manager):
    with loom_serve(
        tiny_model, manager.socket, "tiny", "asyncio", "--no-restart-on-failure"
    ) as server:
        events: list = []
        t = threading.Thread(target=stream_completion, args=(server.base_url, 450, events))
        t.start()
        deadline = time.monotonic() + 30
        while not events:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = list(manager.worker_states())
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        t.join(timeout=30)
        assert server.proc.wait(timeout=30) == 1
        assert "the engine died and restarts are off" in server.output()
    errors = [e for e in events if e != "[DONE]" and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 503, events[-3:]
