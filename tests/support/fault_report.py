"""The reliability suite's report: each fault test records its trials and worst detection time.

`fault_report.record(name, passed, run, worst_s)` adds a row; tests/conftest.py prints the
table at the end of the pytest run (terminal summary), so CI's log carries the figures.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest


@dataclass
class FaultReport:
    rows: list[tuple[str, int, int, str]] = field(default_factory=list)

    def record(self, fault: str, passed: int, run: int, worst_s: float | None) -> None:
        worst = "-" if worst_s is None else f"{worst_s * 1e3:.0f} ms"
        self.rows.append((fault, passed, run, worst))

    def run(
        self, fault: str, trials: int, trial: Callable[[int], float | None], lanes: int = 1
    ) -> None:
        """Run every trial (a failure does not stop the others), record, then assert.

        `trial(i)` returns its detection time in seconds (None where nothing is detected).
        With `lanes` > 1, trial i runs in lane i % lanes: lanes run in parallel threads,
        the trials of one lane one after the other.
        """
        times: list[float | None] = []
        failures: list[str] = []

        def lane(first: int) -> None:
            for i in range(first, trials, lanes):
                try:
                    times.append(trial(i))
                except Exception as exc:  # AssertionError included: the table counts it
                    failures.append(f"trial {i}: {exc!r}")

        threads = [threading.Thread(target=lane, args=(k,)) for k in range(lanes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._finish(fault, trials, times, failures)

    async def run_async(
        self, fault: str, trials: int, trial: Callable[[int], Awaitable[float | None]]
    ) -> None:
        """`run` for trials that are coroutines."""
        times, failures = [], []
        for i in range(trials):
            try:
                times.append(await trial(i))
            except Exception as exc:
                failures.append(f"trial {i}: {exc!r}")
        self._finish(fault, trials, times, failures)

    def _finish(self, fault: str, trials: int, times: list, failures: list[str]) -> None:
        measured = [t for t in times if t is not None]
        self.record(fault, trials - len(failures), trials, max(measured, default=None))
        assert not failures, "\n".join(failures)


REPORT = FaultReport()


def write_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT.rows:
        return
    terminalreporter.section("reliability: fault trials")
    terminalreporter.write_line("| fault | trials passed / run | worst detection |")
    terminalreporter.write_line("|---|---|---|")
    for fault, passed, run, worst in REPORT.rows:
        terminalreporter.write_line(f"| {fault} | {passed} / {run} | {worst} |")
