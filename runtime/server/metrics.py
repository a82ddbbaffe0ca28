"""GET /metrics: the engine's stats in Prometheus' text format, read at scrape time.

A collector turns each model's `engine.stats()` snapshot into families named as vLLM's
(`loomllm:`), one sample per model.
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
from loomllm.server.fleet.fleet import ModelFleet
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
    """Yields the metric families of the server's running engines, one sample per model
    (label model_name).

    The totals are the current engine's: they restart from zero when the supervisor replaces
    it or the model is loaded again, a counter reset that Prometheus' rate() handles; a model
    with no engine yields nothing. With data parallelism the families are the replicas' sums,
    and `replica_*` break them down.
    """

    def __init__(self, engines: Callable[[], list[tuple[str, Engine]]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        rows: list[tuple[str, EngineStats]] = []
        for name, engine in self.engines():
            try:
                rows.append((name, engine.stats()))
            except EngineClosedError:
                continue
        if not rows:
            return
        singles: list[tuple[Any, str, str, Callable[[EngineStats], float]]] = [
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Requests holding KV blocks, in the batch.",
                lambda s: s.num_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Requests queued (new or preempted).",
                lambda s: s.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Share of KV cache blocks in use, 0 to 1.",
                lambda s: s.kv_cache_usage,
            ),
            (
                GaugeMetricFamily,
                "prefix_cache_hit_rate",
                "Share of queried prompt tokens found in the prefix cache, since start.",
                lambda s: s.prefix_cache_hit_rate,
            ),
            (
                CounterMetricFamily,
                "prompt_tokens",
                "Prompt tokens processed (once per request).",
                lambda s: s.num_prompt_tokens,
            ),
            (
                CounterMetricFamily,
                "generation_tokens",
                "Tokens generated.",
                lambda s: s.num_generation_tokens,
            ),
            (
                CounterMetricFamily,
                "num_preemptions",
                "Requests preempted (KV freed, to be recomputed).",
                lambda s: s.num_preemptions,
            ),
        ]
        for family_type, name, doc, value in singles:
            family = family_type(PREFIX + name, doc, labels=["model_name"])
            for model, stats in rows:
                family.add_metric([model], value(stats))
            yield family
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for model, stats in rows:
            reasons = list(FINISH_REASONS) + sorted(set(stats.num_finished) - set(FINISH_REASONS))
            for reason in reasons:
                success.add_metric([model, reason], stats.num_finished.get(reason, 0))
        yield success
        histograms: list[tuple[str, str, Callable[[EngineStats], HistogramSnapshot]]] = [
            (
                "time_to_first_token_seconds",
                "Arrival to a sequence's first token.",
                lambda s: s.time_to_first_token,
            ),
            (
                "inter_token_latency_seconds",
                "Gap between consecutive tokens of one sequence.",
                lambda s: s.inter_token_latency,
            ),
            (
                "e2e_request_latency_seconds",
                "Arrival to a sequence's end.",
                lambda s: s.e2e_request_latency,
            ),
        ]
        for name, doc, snapshot in histograms:
            histogram = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for model, stats in rows:
                snap = snapshot(stats)
                buckets = [(floatToGoString(bound), n) for bound, n in snap.cumulative_buckets()]
                histogram.add_metric([model], buckets, snap.sum)
            yield histogram
        speculating = [(model, stats) for model, stats in rows if stats.spec_accepted_per_pos]
        if speculating:
            yield from _speculation(speculating)
        replicated = [(model, stats.replicas) for model, stats in rows if stats.replicas]
        if replicated:
            yield from _per_replica(replicated)


def _speculation(rows: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Speculative decoding's counters, named as vLLM's spec_decode ones."""
    counters: list[tuple[str, str, Callable[[EngineStats], float]]] = [
        (
            "spec_decode_num_drafts",
            "Requests' steps that verified drafts.",
            lambda s: s.spec_num_drafts,
        ),
        (
            "spec_decode_num_draft_tokens",
            "Draft tokens proposed.",
            lambda s: s.spec_num_draft_tokens,
        ),
        (
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            lambda s: s.spec_num_accepted_tokens,
        ),
    ]
    for name, doc, value in counters:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        for model, stats in rows:
            family.add_metric([model], value(stats))
        yield family
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position among a step's drafts.",
        labels=["model_name", "position"],
    )
    for model, stats in rows:
        for position, count in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([model, str(position)], count)
    yield per_pos


def _per_replica(models: list[tuple[str, tuple[EngineStats, ...]]]) -> Iterator[Metric]:
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
        for model, replicas in models:
            for index, replica in enumerate(replicas):
                family.add_metric([model, str(index)], value(replica))
        yield family


def build_metrics_handler(fleet: ModelFleet) -> Callable[[Request], Awaitable[Response]]:
    """The /metrics endpoint over the fleet's running engines, with its own CollectorRegistry.

    Never the process-wide default registry, so that several apps can live in one process.
    """
    registry = CollectorRegistry(auto_describe=False)  # no describe(): nothing read at register
    registry.register(
        EngineCollector(lambda: [(served.name, served.engine) for served in fleet.running()])
    )
    registry.register(LoopTasksCollector())

    async def metrics_handler(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics_handler
