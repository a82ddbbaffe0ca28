"""GET /metrics: the engine's stats in Prometheus' text format, read at scrape time.

A collector turns one `engine.stats()` snapshot into families named as vLLM's (`loomllm:`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from loomllm.engine.engine import Engine
from loomllm.errors import EngineClosedError
from loomllm.metrics.counters import FINISH_REASONS, HistogramSnapshot
from loomllm.metrics.stats import EngineStats
from loomllm.server.fleet.supervisor import EngineSlot
from loomllm.server.loop_tasks import count_loop_tasks

PREFIX = "loomllm:"


class LoopTasksCollector:
    """The server process' event-loop task count: flat while idle, unless a task leaks."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            PREFIX + "event_loop_tasks",
            "Tasks alive in the server's event loop (all of them, this scrape's included).",
            value=count_loop_tasks(),
        )


class EngineCollector:
    """Yields the metric families of the engine (or the slot's engine) under model_name.

    The totals are the current engine's: they restart from zero when the supervisor replaces
    it, a counter reset that Prometheus' rate() handles; with no engine, nothing is yielded.
    With data parallelism the families are the replicas' sums, and `replica_*` break them down.
    """

    def __init__(self, source: Engine | EngineSlot, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        # The slot's engine itself, not require(): a draining server still reports.
        source = self.source
        engine = source.engine if isinstance(source, EngineSlot) else source
        if engine is None:
            return
        try:
            stats = engine.stats()
        except EngineClosedError:
            return
        labels = [self.model_name]
        yield _gauge(
            "num_requests_running",
            "Requests holding KV blocks, in the batch.",
            labels,
            stats.num_running,
        )
        yield _gauge(
            "num_requests_waiting", "Requests queued (new or preempted).", labels, stats.num_waiting
        )
        yield _gauge(
            "kv_cache_usage_perc",
            "Share of KV cache blocks in use, 0 to 1.",
            labels,
            stats.kv_cache_usage,
        )
        yield _gauge(
            "prefix_cache_hit_rate",
            "Share of queried prompt tokens found in the prefix cache, since start.",
            labels,
            stats.prefix_cache_hit_rate,
        )
        yield _counter(
            "prompt_tokens",
            "Prompt tokens processed (once per request).",
            labels,
            stats.num_prompt_tokens,
        )
        yield _counter(
            "generation_tokens", "Tokens generated.", labels, stats.num_generation_tokens
        )
        yield _counter(
            "num_preemptions",
            "Requests preempted (KV freed, to be recomputed).",
            labels,
            stats.num_preemptions,
        )
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        reasons = list(FINISH_REASONS) + sorted(set(stats.num_finished) - set(FINISH_REASONS))
        for reason in reasons:
            success.add_metric([self.model_name, reason], stats.num_finished.get(reason, 0))
        yield success
        yield _histogram(
            "time_to_first_token_seconds",
            "Arrival to a sequence's first token.",
            labels,
            stats.time_to_first_token,
        )
        yield _histogram(
            "inter_token_latency_seconds",
            "Gap between consecutive tokens of one sequence.",
            labels,
            stats.inter_token_latency,
        )
        yield _histogram(
            "e2e_request_latency_seconds",
            "Arrival to a sequence's end.",
            labels,
            stats.e2e_request_latency,
        )
        if stats.replicas:
            yield from self._per_replica(stats.replicas)

    def _per_replica(self, replicas: tuple[EngineStats, ...]) -> Iterator[Metric]:
        """Data parallel: the main figures again, one sample per replica (label `replica`)."""
        rows: list[tuple[Any, str, str, Callable[[EngineStats], float]]] = [
            (
                GaugeMetricFamily,
                "replica_up",
                "1 while the replica serves, 0 once its worker died.",
                lambda s: float(s.is_alive),
            ),
            (
                GaugeMetricFamily,
                "replica_num_requests_running",
                "Requests in the replica's batch.",
                lambda s: s.num_running,
            ),
            (
                GaugeMetricFamily,
                "replica_num_requests_waiting",
                "Requests queued at the replica.",
                lambda s: s.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "replica_kv_cache_usage_perc",
                "Share of the replica's KV blocks in use, 0 to 1.",
                lambda s: s.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "replica_generation_tokens",
                "Tokens the replica generated.",
                lambda s: s.num_generation_tokens,
            ),
            (
                CounterMetricFamily,
                "replica_requests_finished",
                "Sequences the replica finished, for any reason.",
                lambda s: sum(s.num_finished.values()),
            ),
        ]
        for family_type, name, doc, value in rows:
            family = family_type(PREFIX + name, doc, labels=["model_name", "replica"])
            for index, replica in enumerate(replicas):
                family.add_metric([self.model_name, str(index)], value(replica))
            yield family


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    return _single(GaugeMetricFamily, name, doc, labels, value)


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    return _single(CounterMetricFamily, name, doc, labels, value)


def _single(family_type: Any, name: str, doc: str, labels: list[str], value: float) -> Any:
    """A family of `family_type` with one sample, labelled model_name."""
    family = family_type(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _histogram(
    name: str, doc: str, labels: list[str], snap: HistogramSnapshot
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
    buckets = [(floatToGoString(bound), n) for bound, n in snap.cumulative_buckets()]
    family.add_metric(labels, buckets, snap.sum)
    return family


def build_metrics_handler(
    source: Engine | EngineSlot, model_name: str
) -> Callable[[Request], Awaitable[Response]]:
    """The /metrics endpoint over `source`, with its own CollectorRegistry.

    Never the process-wide default registry, so that several apps can live in one process.
    """
    registry = CollectorRegistry(auto_describe=False)  # no describe(): nothing read at register
    registry.register(EngineCollector(source, model_name))
    registry.register(LoopTasksCollector())

    async def metrics_handler(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics_handler
