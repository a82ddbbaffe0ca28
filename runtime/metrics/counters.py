"""The engine's cumulative counters and latency histograms, recorded by the OutputProcessor.

Plain Python, no exporter: the server's /metrics renders EngineCore.stats() at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Upper bounds in seconds, as vLLM's: the first token from 1 ms to ~40 min, the gap between
# tokens from 10 ms to 80 s, a whole request from 0.3 s to ~2 h.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# "error": the worker failed the step that held the sequence, or the engine died.
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram at one instant. `counts[i]` counts values in (bounds[i-1], bounds[i]];
    the last entry counts values above every bound (Prometheus' +Inf bucket)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def __add__(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """Two histograms of the same buckets as one (data-parallel replicas' merge)."""
        if other.bounds != self.bounds:
            raise ValueError("histograms with different bounds do not add")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(
            self.bounds, counts, self.sum + other.sum, self.count + other.count
        )

    def cumulative_buckets(self) -> list[tuple[float, int]]:
        """(upper bound, values <= it) pairs, ending with (inf, count): Prometheus' `le`."""
        total, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            buckets.append((bound, total))
        return buckets


class Histogram:
    """Fixed buckets, a sum and a count; `observe` costs one bisect and three additions."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be strictly increasing, got {bounds!r}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` (`times` times); a value equal to a bound falls in that bound's bucket."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum, self.count)


class EngineMetrics:
    """Totals since the engine started.

    Latencies are per sequence: a request with n=2 gives two first tokens, two e2e
    latencies and two finishes (as vLLM, whose n>1 children are separate requests), so
    the e2e count always equals the sum of `num_finished`. Prompt tokens count once per
    request, as the API's usage does, when its first token arrives (a prompt that is
    preempted and recomputed counts once; one aborted before its first token not at all).
    """

    __slots__ = (
        "num_prompt_tokens",
        "num_generation_tokens",
        "num_finished",
        "time_to_first_token",
        "inter_token_latency",
        "e2e_request_latency",
    )

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.time_to_first_token = Histogram(TTFT_BUCKETS)  # arrival -> a sequence's 1st token
        self.inter_token_latency = Histogram(ITL_BUCKETS)  # between a sequence's tokens
        self.e2e_request_latency = Histogram(E2E_BUCKETS)  # arrival -> the sequence finished

    def record_tokens(self, num_new_tokens: int, is_first: bool, since: float, now: float) -> None:
        """One sequence got tokens at `now`; `since` is its arrival (first) or last token time."""
        self.num_generation_tokens += num_new_tokens
        (self.time_to_first_token if is_first else self.inter_token_latency).observe(now - since)
        if num_new_tokens > 1:  # delivered together: no gap between them
            self.inter_token_latency.observe(0.0, num_new_tokens - 1)

    def record_finished(self, finish_reason: str, arrival_time: float, now: float) -> None:
        self.num_finished[finish_reason] = self.num_finished.get(finish_reason, 0) + 1
        self.e2e_request_latency.observe(now - arrival_time)
