"""The CPU thread governor (device/cpu_threads.py) on a fake clock and fake /proc readings:
it shrinks the team when its threads wait for cores, grows it back when a core sits idle or a
later try finds one, backs off tries that fail, stays within 1..max, and can be turned off;
and its real readings of /proc move as they should."""

from __future__ import annotations

import os
import time

import pytest

from loomllm.workers.device import cpu_threads
from loomllm.workers.device.cpu_threads import (
    ENV,
    PROBE_NS,
    WINDOW_NS,
    CpuThreadGovernor,
    adaptive_threads_enabled,
)

TICKS_PER_S = 100
STEP_NS = 10_000_000


class Cores:
    """A fake clock and /proc: each step lasts STEP_NS, during which the worker's threads wait
    `waiting` threads' worth and the cores beyond its team sit `idle` cores' worth."""

    def __init__(self) -> None:
        self.now = 0
        self.waited = 0
        self.idled = 0.0
        self.waiting = 0.0
        self.idle = 0.0
        self.sets: list[int] = []

    def governor(self, max_threads: int = 2) -> CpuThreadGovernor:
        return CpuThreadGovernor(
            max_threads,
            self.sets.append,
            clock=lambda: self.now,
            read_waiting=lambda: self.waited,
            read_idle=lambda: int(self.idled),
            ticks_per_s=TICKS_PER_S,
        )

    def until(self, governor: CpuThreadGovernor, threads: int) -> int:
        """Step until the team has `threads` threads; the time it changed."""
        for _ in range(100 * PROBE_NS // STEP_NS):
            if governor.threads == threads:
                return self.now
            self.steps(governor, 1)
        raise AssertionError(f"never reached {threads} threads")

    def steps(self, governor: CpuThreadGovernor, count: int) -> None:
        for _ in range(count):
            with governor.step():
                self.now += STEP_NS
                self.waited += int(self.waiting * STEP_NS)
                self.idled += self.idle * TICKS_PER_S * STEP_NS / 1e9


WINDOW_STEPS = WINDOW_NS // STEP_NS


def test_alone_on_its_cores_the_team_stays_whole():
    cores = Cores()
    cores.waiting = 0.1  # its engine's process and the system
    governor = cores.governor()
    cores.steps(governor, 50 * WINDOW_STEPS)
    assert governor.threads == 2 and cores.sets == []


def test_threads_waiting_for_cores_shrink_the_team_after_a_window(caplog):
    cores = Cores()
    governor = cores.governor(max_threads=8)
    cores.steps(governor, 1)  # the first window starts with it
    cores.waiting = 3.2
    cores.steps(governor, WINDOW_STEPS - 2)
    assert governor.threads == 8, "judged before its window was over"
    with caplog.at_level("INFO", logger=cpu_threads.__name__):
        cores.steps(governor, 1)
    assert governor.threads == 5 and cores.sets == [5]  # ~three threads' worth waited
    assert "5 of its 8 threads" in caplog.text and ENV in caplog.text
    cores.steps(governor, 100 * WINDOW_STEPS)
    assert governor.threads == 1 and min(cores.sets) == 1  # never below one


def test_an_idle_core_grows_the_team_back_at_once():
    cores = Cores()
    governor = cores.governor()
    cores.waiting = 1.0
    cores.steps(governor, 2 * WINDOW_STEPS)
    assert governor.threads == 1
    cores.waiting, cores.idle = 0.0, 0.9  # the other worker finished
    cores.steps(governor, WINDOW_STEPS + 1)
    assert governor.threads == 2 and cores.sets == [1, 2]
    cores.steps(governor, 20 * WINDOW_STEPS)
    assert cores.sets == [1, 2], "past its max"


def test_without_an_idle_core_it_tries_again_later_and_backs_off_while_taken():
    cores = Cores()
    governor = cores.governor()
    cores.waiting = 1.0  # a second busy worker for good
    changed = cores.until(governor, 1)
    gaps = []
    for _ in range(4):
        cores.waiting = 0.3  # one thread beside the other worker waits its share
        tried = cores.until(governor, 2)
        gaps.append(tried - changed)
        cores.waiting = 1.0
        changed = cores.until(governor, 1)
        assert changed - tried <= WINDOW_NS + STEP_NS  # taken back after one window
    # Each try waits for its interval, doubled after each try the cores took back.
    assert PROBE_NS <= gaps[0] < PROBE_NS + WINDOW_NS + STEP_NS
    assert all(
        2 * a <= b < 2 * a + WINDOW_NS + STEP_NS for a, b in zip(gaps, gaps[1:], strict=False)
    )


def test_a_try_that_holds_resets_the_back_off():
    cores = Cores()
    governor = cores.governor()
    cores.waiting = 1.0
    changed = cores.until(governor, 1)
    cores.waiting = 0.3
    assert cores.until(governor, 2) - changed >= PROBE_NS  # the try
    cores.waiting = 0.1  # and the core is free
    cores.steps(governor, 3 * WINDOW_STEPS)
    assert governor.threads == 2
    cores.waiting = 1.0  # taken again: the next try comes after the first interval, not double
    changed = cores.until(governor, 1)
    cores.waiting = 0.3
    assert PROBE_NS <= cores.until(governor, 2) - changed < PROBE_NS + WINDOW_NS + STEP_NS


def test_a_failed_step_still_counts_and_the_error_passes_through():
    cores = Cores()
    governor = cores.governor()
    cores.steps(governor, 1)
    cores.waiting = 1.0
    with pytest.raises(RuntimeError, match="boom"), governor.step():
        cores.now += WINDOW_NS
        cores.waited += WINDOW_NS
        raise RuntimeError("boom")
    assert governor.threads == 1


def test_at_least_one_thread():
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        CpuThreadGovernor(0, lambda n: None)


@pytest.mark.parametrize(
    "value, enabled", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)]
)
def test_the_environment_turns_it_off(value, enabled, monkeypatch):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert adaptive_threads_enabled() is enabled


@pytest.mark.parametrize(
    "env, spin",
    [
        ({}, cpu_threads.GOMP_SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "5"}, "5"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
    ],
)
def test_openmp_spins_briefly_unless_the_environment_says_otherwise(env, spin, monkeypatch):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cpu_threads.default_openmp_spin()
    assert os.environ.get("GOMP_SPINCOUNT") == spin


def test_without_proc_it_stays_off_and_reads_no_waiting(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    real_isdir, real_listdir = os.path.isdir, os.listdir

    def no_proc(path):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_listdir(path)

    monkeypatch.setattr(
        os.path, "isdir", lambda p: not str(p).startswith("/proc") and real_isdir(p)
    )
    monkeypatch.setattr(os, "listdir", no_proc)
    assert adaptive_threads_enabled() is False
    assert cpu_threads.waiting_ns() == 0


def test_the_real_readings_move_with_the_machine():
    """A team of three threads on one core keeps two of them runnable and waiting, so the
    process's waiting time grows; idle ticks never go back."""
    import torch

    idle, waited = cpu_threads.idle_ticks(), cpu_threads.waiting_ns()
    assert idle >= 0 and waited >= 0
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    a = torch.randn(512, 512)
    try:
        os.sched_setaffinity(0, {min(cores)})
        torch.set_num_threads(3)
        stop = time.monotonic() + 0.3
        while time.monotonic() < stop:
            a @ a
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
    assert cpu_threads.waiting_ns() > waited + 10_000_000
    assert cpu_threads.idle_ticks() >= idle
