"""EngineStats: one snapshot of an engine's queues, KV blocks and totals, and their merge.

EngineCore.stats() takes one replica's; with data parallelism the Engine merges them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loomllm.metrics.counters import HistogramSnapshot
from loomllm.metrics.step_timings import StepTimings


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine now (queues, KV blocks) and its totals since start (runtime/metrics/counters.py).

    Latency histograms and finishes are per sequence (n=2 counts twice); prompt tokens
    once per request.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_finished: dict[str, int]  # by finish reason: stop, length, abort, error
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    e2e_request_latency: HistogramSnapshot
    # Where the step loop's time went, by phase (runtime/metrics/step_timings.py).
    step_timings: StepTimings = dataclasses.field(default_factory=StepTimings)
    num_prefix_cache_queries: int = 0  # prompt tokens looked up: the hit rate's weight
    is_alive: bool = True  # False: a replica whose worker died (its gauges are zero)
    # Data parallel: each replica's own stats, in replica order (empty for one replica).
    replicas: tuple[EngineStats, ...] = ()
    # Speculative decoding (vLLM's spec_decode metrics): a request's steps that verified
    # drafts, the draft tokens, those accepted, and acceptances by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of the draft tokens accepted (0 without speculation)."""
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by requests, 0..1 (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: totals add up; `replicas` keeps each one's.

    The queues and KV blocks are the live replicas' (a dead one serves nothing); the
    prefix-cache hit rate is weighted by the tokens each replica looked up.
    """
    if len(parts) == 1:
        return parts[0]
    now = [p for p in parts if p.is_alive] or parts
    queries = sum(p.num_prefix_cache_queries for p in parts)
    hits = sum(p.prefix_cache_hit_rate * p.num_prefix_cache_queries for p in parts)
    finished: Counter[str] = Counter()
    for p in parts:
        finished.update(p.num_finished)
    return EngineStats(
        num_running=sum(p.num_running for p in now),
        num_waiting=sum(p.num_waiting for p in now),
        num_free_blocks=sum(p.num_free_blocks for p in now),
        num_total_blocks=sum(p.num_total_blocks for p in now),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_steps=sum(p.num_steps for p in parts),
        num_preemptions=sum(p.num_preemptions for p in parts),
        num_prompt_tokens=sum(p.num_prompt_tokens for p in parts),
        num_generation_tokens=sum(p.num_generation_tokens for p in parts),
        num_finished=dict(finished),
        time_to_first_token=_sum(p.time_to_first_token for p in parts),
        inter_token_latency=_sum(p.inter_token_latency for p in parts),
        e2e_request_latency=_sum(p.e2e_request_latency for p in parts),
        step_timings=_sum(p.step_timings for p in parts),
        num_prefix_cache_queries=queries,
        is_alive=any(p.is_alive for p in parts),
        replicas=tuple(parts),
        spec_num_drafts=sum(p.spec_num_drafts for p in parts),
        spec_num_draft_tokens=sum(p.spec_num_draft_tokens for p in parts),
        spec_num_accepted_tokens=sum(p.spec_num_accepted_tokens for p in parts),
        spec_accepted_per_pos=tuple(
            map(sum, zip(*(p.spec_accepted_per_pos for p in parts), strict=True))
        ),
    )


def _sum(values: Iterable[Any]) -> Any:
    """The sum of HistogramSnapshots, or of StepTimings (both define +)."""
    it = iter(values)
    total = next(it)
    for value in it:
        total = total + value
    return total
