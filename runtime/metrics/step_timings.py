"""Where the engine's step loop spends its time: per-phase wall-clock totals since start.

EngineCore drives a StepClock; a few perf_counter reads a step are cheap enough to stay on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("schedule", "encode", "worker", "receive", "update", "output")


@dataclass(slots=True)
class StepTimings:
    """Seconds summed over `num_steps` steps, by phase; the phases add up to `total_s`.

    `worker_s` is what the worker reports for its own execute (forward and sampling);
    `receive_s` is the rest of the wait for the reply: both socket writes, the worker's
    decode of the step and encode of its result, the engine's decode and wake-up. Other
    tasks of the engine's event loop (the request streams' consumers) run during that
    wait, in parallel with the worker: they show in `receive_s` only where they take
    longer than the worker.
    """

    num_steps: int = 0
    schedule_s: float = 0.0  # scheduler.schedule()
    encode_s: float = 0.0  # build and encode the ExecuteStep (once for all ranks)
    worker_s: float = 0.0  # the worker's own execute time
    receive_s: float = 0.0  # the rest of the call, until the reply is in (see above)
    update_s: float = 0.0  # scheduler.update_from_output()
    output_s: float = 0.0  # detokenize, check stops, put outputs in the request streams
    total_s: float = 0.0  # whole steps, first phase to last
    # Not a phase: from a step's reply in to the next step's frame out, the engine's part of
    # the time a worker waits between steps (with async scheduling, what the device may idle
    # for). Counted for each send that follows a reply.
    num_turnarounds: int = 0
    turnaround_s: float = 0.0

    @property
    def outside_forward_s(self) -> float:
        """Step time that is not the worker's execute: the engine's overhead."""
        return self.total_s - self.worker_s

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, "outside_forward" and "total"; and
        "turnaround", per turnaround."""
        n = max(self.num_steps, 1)
        ms = {phase: getattr(self, f"{phase}_s") * 1e3 / n for phase in PHASES}
        ms["outside_forward"] = self.outside_forward_s * 1e3 / n
        ms["total"] = self.total_s * 1e3 / n
        ms["turnaround"] = self.turnaround_s * 1e3 / max(self.num_turnarounds, 1)
        return ms

    def __add__(self, other: StepTimings) -> StepTimings:
        """Two loops' timings together (data-parallel replicas' merge)."""
        return StepTimings(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def __sub__(self, earlier: StepTimings) -> StepTimings:
        """The timings of the steps between two snapshots (`after - before`)."""
        return StepTimings(
            *(getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self))
        )


class StepClock:
    """Marks one step at a time: `start()`, then one call per phase in order, `finish()` last.

    A step's phases are the gaps between its marks, so they add up to exactly its total.
    Only `finish()` adds them to the totals: a snapshot taken mid-step holds whole steps.
    The output phase may come in two parts: a step's own outputs after `updated()`, and
    (async scheduling) the last step's, streamed between `stream_began()` and `streamed()`
    while this one waits for its reply. `sent()`, once a step's frame is out, adds the
    turnaround since the last reply.
    """

    __slots__ = ("totals", "_now", "_marks", "_worker_s", "_reply_at", "_streamed_s")

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.totals = StepTimings()
        self._now = now
        self._marks = [0.0] * 5  # start, scheduled, encoded, replied, updated
        self._worker_s = 0.0
        self._reply_at: float | None = None  # the last reply, until a send follows it
        self._streamed_s = 0.0  # the last step's outputs, streamed during this one's wait

    def start(self) -> None:
        self._marks[0] = self._now()

    def scheduled(self) -> None:
        self._marks[1] = self._now()

    def encoded(self) -> None:
        self._marks[2] = self._now()

    def stream_began(self) -> None:
        self._streamed_s = -self._now()

    def streamed(self) -> None:
        self._streamed_s += self._now()

    def replied(self, worker_s: float) -> None:
        """`worker_s`: the worker's own execute time, from its reply (0 if it failed)."""
        self._marks[3] = self._marks[4] = self._reply_at = self._now()  # in case no update
        self._worker_s = worker_s

    def idle(self) -> None:
        """The loop waits for something else than a step (work, a failed step's drain): the
        next send's turnaround does not run from the last reply."""
        self._reply_at = None

    def sent(self) -> None:
        if self._reply_at is not None:
            t = self.totals
            t.num_turnarounds += 1
            t.turnaround_s += self._now() - self._reply_at
            self._reply_at = None

    def updated(self) -> None:
        self._marks[4] = self._now()

    def finish(self) -> None:
        end = self._now()
        start, scheduled, encoded, replied, updated = self._marks
        streamed_s, self._streamed_s = self._streamed_s, 0.0
        # The worker ran while the last step's outputs streamed: wall time is charged to the
        # output phase first, and the worker's report may be cut to what is left of the wait.
        wait = replied - encoded - streamed_s
        # Same monotonic clock in both processes, but never let a report exceed the wait.
        worker_s = min(max(self._worker_s, 0.0), wait)
        t = self.totals
        t.num_steps += 1
        t.schedule_s += scheduled - start
        t.encode_s += encoded - scheduled
        t.worker_s += worker_s
        t.receive_s += wait - worker_s
        t.update_s += updated - replied
        t.output_s += end - updated + streamed_s
        t.total_s += end - start

    def snapshot(self) -> StepTimings:
        return dataclasses.replace(self.totals)
