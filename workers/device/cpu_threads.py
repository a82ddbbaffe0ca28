"""CpuThreadGovernor: a CPU worker's OpenMP team sized to the cores it actually gets.

A team of one thread per core waits at every op's barrier for its slowest member; when another
busy process (a second worker, a load generator) holds one of those cores, that member waits
a whole time slice, and a step takes many times as long. The governor watches how long the
worker's threads wait for a core and shrinks the team while the cores are taken.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# Steps are judged over windows of at least this much time. A window that spans an idle
# spell between requests reads as calm and spare: at worst it delays a shrink by a window, or
# tries one more thread, which the next window takes back if the cores are still taken.
WINDOW_NS = 100_000_000
# Other work holds the cores when a process's threads spend, on average, this many threads'
# worth of the time runnable but not running: the team then shrinks. Alone on its cores a
# worker measures ~0.1 (its engine's process and the system); beside a second busy worker, ~1.
CONTENDED_WAITING = 0.5
# It grows back at once when a core beyond its team sat this idle over a window, or else
# tries one more thread after PROBE_NS, doubled after each try that had to shrink again.
GROW_IDLE = 0.75
PROBE_NS = 2_000_000_000
MAX_PROBE_NS = 32_000_000_000
ENV = "LOOM_CPU_ADAPTIVE_THREADS"
# How many rounds libgomp's threads spin for the next parallel region before they sleep. Its
# default, 300,000, lasts milliseconds: a worker's helper threads spun through the gap between
# its steps, on the core its engine's process needed then. This many last a fraction of a
# millisecond: through the gaps inside a step, not the gap between steps.
GOMP_SPIN_COUNT = "10000"


def waiting_ns() -> int:
    """Nanoseconds this process's threads have spent runnable but not running (the second
    field of each thread's /proc schedstat); 0 without /proc (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total


def idle_ticks() -> int:
    """Idle and iowait clock ticks of the cores this process may run on, from /proc/stat."""
    mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    total = 0
    with open("/proc/stat", "rb") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0].decode() in mine:
                total += int(fields[4]) + int(fields[5])
    return total


def default_openmp_spin() -> None:
    """Give the processes started from here (workers, before they import torch, which reads
    it) GOMP_SPIN_COUNT, unless the environment sets GOMP_SPINCOUNT or OpenMP's wait policy."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)


def adaptive_threads_enabled() -> bool:
    """False where the environment turns the governor off (`LOOM_CPU_ADAPTIVE_THREADS=0`), or
    where there is no /proc to read it from."""
    if not os.path.isdir("/proc/self/task") or not hasattr(os, "sched_getaffinity"):
        return False
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class CpuThreadGovernor:
    """Wrap each step in `step()`; between steps the team may shrink or grow by the rules
    above, never past `max_threads`. The kernel choices stay those measured at start, and
    the quantized and bfloat16 kernels split work by output, not inside a sum: their tokens
    and logprobs hold at any thread count. torch's float32 matmuls do not always (their last
    bits may move), which `LOOM_CPU_ADAPTIVE_THREADS=0` rules out."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        read_waiting: Callable[[], int] = waiting_ns,
        read_idle: Callable[[], int] = idle_ticks,
        ticks_per_s: int | None = None,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = self.threads = max_threads
        self._set_threads = set_threads
        self._clock = clock
        self._read_waiting = read_waiting
        self._read_idle = read_idle
        self._ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self._window: tuple[int, int, int] | None = None  # (start, waiting, idle) at its start
        self._changed_at = 0
        self._probe_ns = PROBE_NS
        self._probing = False  # the last change was a try at one more thread
        self._told = False

    @contextmanager
    def step(self) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._after(start)

    def _after(self, step_start: int) -> None:
        now = self._clock()
        if self._window is None:
            # Waiting and idle time are read at window ends only: /proc reads cost more than
            # a clock, and the window began at this step's start, close enough.
            self._window = (step_start, self._read_waiting(), self._read_idle())
            return
        began, waited, idle = self._window
        elapsed = now - began
        if elapsed < WINDOW_NS:
            return
        waited_now, idle_now = self._read_waiting(), self._read_idle()  # once a window
        waiting = (waited_now - waited) / elapsed
        if self.threads > 1 and waiting >= CONTENDED_WAITING:
            if self._probing:  # the core it tried for is still taken: try later
                self._probe_ns = min(2 * self._probe_ns, MAX_PROBE_NS)
            self._change(max(1, self.threads - max(1, round(waiting))), now, probing=False)
        else:
            if self._probing:  # the try held for a window: that core is free again
                self._probing = False
                self._probe_ns = PROBE_NS
            if self.threads < self.max_threads:
                spare = (idle_now - idle) / self._ticks_per_s / (elapsed / 1e9)
                if spare >= GROW_IDLE:
                    self._change(self.threads + 1, now, probing=False)
                elif now - self._changed_at >= self._probe_ns:
                    self._change(self.threads + 1, now, probing=True)
        self._window = (now, waited_now, idle_now)

    def _change(self, threads: int, now: int, *, probing: bool) -> None:
        level = logging.DEBUG if self._told else logging.INFO
        self._told = True
        logger.log(
            level,
            "CPU worker: %d of its %d threads from now on (%s; %s=0 keeps them all)",
            threads,
            self.max_threads,
            "other work holds its cores" if threads < self.threads else "cores came free",
            ENV,
        )
        self._set_threads(threads)
        self.threads = threads
        self._changed_at = now
        self._probing = probing
