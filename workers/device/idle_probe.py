"""DeviceIdleProbe: how long the device sits idle between a worker's steps, and busy in them.

Off unless a benchmark turns it on (`Engine.collective_rpc`, see benchmarks/gpu_bench.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Idle gaps this long or longer are stalls, counted apart: a few long stalls (a garbage
# collection, a compile, a slow schedule) and many short gaps (the host's work each step)
# are different problems.
STALL_S = 1e-3


@dataclass(frozen=True, slots=True)
class DeviceTime:
    steps: int
    busy_s: float  # in steps: from a forward queued to its sampling done
    idle_s: float  # between steps: from one step's sampling done to the next forward queued
    eager_steps: int  # the steps that ran eager (the others replayed a graph)
    eager_busy_s: float
    prompt_steps: int  # the steps that computed prompt tokens (the others only decoded)
    prompt_busy_s: float
    stalls: int  # idle gaps of STALL_S or longer
    stall_s: float  # their idle time, part of idle_s
    longest_gap_s: float

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / max(self.busy_s + self.idle_s, 1e-12)

    @property
    def decode_only_steps(self) -> int:
        return self.steps - self.prompt_steps

    @property
    def decode_only_busy_s(self) -> float:
        return self.busy_s - self.prompt_busy_s


class DeviceIdleProbe:
    """Marks when each step's forward and its sampling are queued; idle is the time between
    one step's end mark and the next one's start mark, the host work the device waited for."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self._cuda = device.type == "cuda"
        self._clock = clock  # the CPU's marks
        self._marks: list[tuple[Any, Any, bool, bool]] = []  # (start, end, replayed, prompts)
        self._open: Any = None

    def _mark(self) -> Any:
        # A CUDA event completes when the device reaches it, so a mark queued while the device
        # is still busy with the step before adds no idle time. On the CPU a launch computes
        # the whole step, so the host's clock is the device's.
        if not self._cuda:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_started(self) -> None:
        self._open = self._mark()

    def step_ended(self, replayed: bool, with_prompts: bool = False) -> None:
        if self._open is not None:
            self.record(self._open, self._mark(), replayed, with_prompts)
            self._open = None

    def record(self, start: Any, end: Any, replayed: bool, with_prompts: bool) -> None:
        """One step's marks as `step_started` and `step_ended` take them, or (an emulated
        device, on the CPU) the host-clock times it held the device."""
        self._marks.append((start, end, replayed, with_prompts))

    def result(self) -> DeviceTime:
        """Busy and idle time over the marked steps (waits for the device to reach them)."""
        if self._cuda:
            torch.cuda.synchronize()

        def seconds(a: Any, b: Any) -> float:
            return a.elapsed_time(b) / 1e3 if self._cuda else b - a

        marks = self._marks
        busy = sum(seconds(start, end) for start, end, _, _ in marks)
        gaps = [seconds(marks[i][1], marks[i + 1][0]) for i in range(len(marks) - 1)]
        stalls = [gap for gap in gaps if gap >= STALL_S]
        eager = [seconds(start, end) for start, end, replayed, _ in marks if not replayed]
        prompts = [seconds(start, end) for start, end, _, prompt in marks if prompt]
        return DeviceTime(
            len(marks),
            busy,
            sum(gaps),
            len(eager),
            sum(eager),
            len(prompts),
            sum(prompts),
            len(stalls),
            sum(stalls),
            max(gaps, default=0.0),
        )
