"""Step timings: the clock's laps add up, and a real engine fills every phase consistently."""

from __future__ import annotations

import time

import anyio
import pytest

from loomllm import Engine, SamplingParams
from loomllm.metrics.step_timings import PHASES, StepClock, StepTimings


def test_clock_charges_each_lap_to_its_phase_and_clamps_the_worker_report():
    ticks = iter([10.0, 10.5, 11.0, 14.0, 14.25, 15.0, 20.0, 20.5, 21.0, 22.0, 22.5, 23.0])
    clock = StepClock(now=lambda: next(ticks))
    clock.start()
    clock.scheduled()  # 0.5
    clock.encoded()  # 0.5
    clock.replied(worker_s=2.0)  # a 3 s wait: 2 s worker, 1 s receive
    clock.updated()  # 0.25
    clock.finish()  # 0.75
    first = clock.snapshot()
    clock.start()
    clock.scheduled()
    clock.encoded()
    clock.replied(worker_s=9.0)  # more than the 1 s wait: charged as 1 s
    clock.updated()
    clock.finish()
    assert first == StepTimings(1, 0.5, 0.5, 2.0, 1.0, 0.25, 0.75, 5.0)
    step = clock.snapshot() - first
    assert step == StepTimings(1, 0.5, 0.5, 1.0, 0.0, 0.5, 0.5, 3.0)
    assert first.num_steps == 1  # the snapshot is a copy
    ms = step.per_step_ms()
    assert [ms[p] for p in PHASES] == [500.0, 500.0, 1000.0, 0.0, 500.0, 500.0]
    assert (ms["outside_forward"], ms["total"]) == (2000.0, 3000.0)


def test_outputs_streamed_during_the_wait_count_as_output_not_receive():
    ticks = iter([0.0, 1.0, 2.0, 2.5, 4.5, 10.0, 10.5, 11.0])
    clock = StepClock(now=lambda: next(ticks))
    clock.start()
    clock.scheduled()  # 1.0
    clock.encoded()  # 1.0
    clock.stream_began()  # 2.5: the last step's outputs, 2 s
    clock.streamed()
    clock.replied(worker_s=4.0)  # a 8 s wait less the 2 s of outputs: 4 worker, 2 receive
    clock.updated()  # 0.5
    clock.finish()  # 0.5 more output: this step's own (without async scheduling)
    assert clock.snapshot() == StepTimings(1, 1.0, 1.0, 4.0, 2.0, 0.5, 2.5, 11.0)


def test_turnaround_runs_from_a_reply_to_the_next_send_only():
    ticks = iter([2.0, 3.0, 7.5, 9.0, 10.0])  # sends with no reply before them read no clock
    clock = StepClock(now=lambda: next(ticks))
    clock.sent()  # no reply before it (the first step, or one sent ahead)
    clock.replied(worker_s=0.0)  # 2.0
    clock.sent()  # 3.0: 1 s after the reply
    clock.sent()  # sent ahead: no new reply
    clock.replied(worker_s=0.0)  # 7.5
    clock.sent()  # 9.0: 1.5 s
    clock.replied(worker_s=0.0)  # 10.0
    clock.idle()  # then the loop waits for work (or drains a failed step): no turnaround
    clock.sent()
    t = clock.totals
    assert (t.num_turnarounds, t.turnaround_s) == (2, 2.5)
    assert t.num_steps == 0  # not a phase: no step is counted by it
    assert t.per_step_ms()["turnaround"] == 1250.0


@pytest.mark.anyio
async def test_engine_fills_every_phase_consistently(tiny_model, shared_manager):
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    async def run(prompt: list[int]) -> None:
        async for _ in engine.generate({"prompt_token_ids": prompt}, params):
            pass

    start = time.perf_counter()
    async with Engine(tiny_model, manager_socket=shared_manager.socket, dtype="float32") as engine:
        assert engine.stats().step_timings == StepTimings()
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, [5 + i, 17, 42, 99])
        first = engine.stats()
        await run([11, 12, 13])
        second = engine.stats()
    wall = time.perf_counter() - start

    t = second.step_timings
    assert t.num_steps == second.num_steps >= 4 + 4  # 4 tokens each: at least 4 steps a run
    assert (t - first.step_timings).num_steps == second.num_steps - first.num_steps
    phases = [getattr(t, f"{p}_s") for p in PHASES]
    assert all(s >= 0 for s in phases), t
    assert sum(phases) == pytest.approx(t.total_s, rel=1e-9)
    assert t.total_s <= wall
    assert t.worker_s > 0 and t.encode_s > 0 and t.receive_s > 0 and t.output_s > 0, t
    assert 0 < t.outside_forward_s < t.total_s
    # Every step but the first of each burst of work is sent after a reply.
    assert 0 < t.num_turnarounds < t.num_steps and 0 < t.turnaround_s < t.total_s
