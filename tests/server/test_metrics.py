"""GET /metrics: the Histogram against a direct count, the collector's rendering of a fixed
EngineStats, and the counters of a real served tiny model against the responses' usage.

Latencies and finishes are per sequence (n=2 counts twice); prompt tokens once per request.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Route
from support.servers import running

from loomllm.core.scheduler import EngineCoreOutput
from loomllm.engine.output_processor import OutputProcessor, ParentRequest
from loomllm.metrics.counters import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    Histogram,
)
from loomllm.metrics.stats import EngineStats
from loomllm.outputs import RequestMetrics, RequestOutputCollector
from loomllm.protocols.sampling import SamplingParams
from loomllm.server.fleet.fleet import ServedModel
from loomllm.server.loop_tasks import count_loop_tasks
from loomllm.server.metrics import build_metrics_handler
from loomllm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

NAME = "tiny"
P = "loomllm:"


def test_histogram_matches_a_direct_count():
    rng = random.Random(0)
    bounds = (0.01, 0.1, 0.5, 1.0, 10.0)
    # Values on the bounds too: Prometheus' buckets are `le`, so they belong to that bucket.
    values = [rng.choice([rng.uniform(-1, 20), rng.choice(bounds)]) for _ in range(500)]
    hist = Histogram(bounds)
    for v in values:
        hist.observe(v)
    hist.observe(0.5, times=3)
    values += [0.5] * 3
    snap = hist.snapshot()
    expected = [(b, sum(v <= b for v in values)) for b in (*bounds, float("inf"))]
    assert snap.cumulative_buckets() == expected
    assert snap.count == len(values) and sum(snap.counts) == len(values)
    assert snap.sum == pytest.approx(sum(values))
    hist.observe(100.0)
    assert snap.count == len(values)  # a snapshot does not move
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((1.0, 1.0))


def out(request_id: str, num_tokens: int, finish_reason: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, [5] * num_tokens, [0.0] * num_tokens, [None] * num_tokens, finish_reason, None
    )


def test_output_processor_records_per_sequence(tiny_model):
    processor = OutputProcessor(Tokenizer.from_model_dir(tiny_model))
    m = processor.metrics

    def add(request_id: str, n: int) -> ParentRequest:
        params = SamplingParams(n=n, max_tokens=10)
        parent = ParentRequest(
            request_id,
            None,
            [1, 2, 3],
            params,
            RequestOutputCollector(params.output_kind),
            RequestMetrics(arrival_time=time.time()),
        )
        processor.add(parent)
        return parent

    add("a", 2)
    add("b", 1)
    processor.process([out("0_a", 1), out("1_a", 1), out("b", 2)])  # b: 2 tokens in one step
    assert m.num_prompt_tokens == 6  # a's prompt once, b's once
    assert m.time_to_first_token.count == 3 and m.inter_token_latency.count == 1
    processor.process([out("0_a", 1, "length"), out("1_a", 1), out("b", 1)])
    assert m.num_generation_tokens == 7 and m.inter_token_latency.count == 4
    assert m.num_finished == {"stop": 0, "length": 1, "abort": 0, "error": 0}
    processor.remove("a", "error")  # only 1_a is still running
    processor.remove("b")
    assert m.num_finished == {"stop": 0, "length": 1, "abort": 1, "error": 1}
    assert m.e2e_request_latency.count == 3 and m.time_to_first_token.count == 3
    assert m.num_prompt_tokens == 6


class StubEngine:
    """All the collector reads of an Engine."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def fixed_stats() -> EngineStats:
    m = EngineMetrics()
    m.num_prompt_tokens = 11
    m.record_tokens(1, True, 0.0, 0.003)
    m.record_tokens(3, False, 0.003, 0.2)  # gaps 0.197, 0, 0
    m.record_finished("length", 0.0, 0.2)
    m.record_finished("abort", 0.0, 5000.0)
    return EngineStats(
        3,
        2,
        6,
        8,
        0.25,
        99,
        4,
        m.num_prompt_tokens,
        m.num_generation_tokens,
        dict(m.num_finished),
        m.time_to_first_token.snapshot(),
        m.inter_token_latency.snapshot(),
        m.e2e_request_latency.snapshot(),
    )


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels but model_name): value}; every engine sample has
    model_name="tiny" (the process' event_loop_tasks has no labels)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == P + "event_loop_tasks":
                assert s.labels == {} and s.value >= 1, s
                continue
            labels = dict(s.labels)
            assert labels.pop("model_name") == NAME, s
            samples[s.name, frozenset(labels.items())] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[P + name, frozenset(labels.items())]


def buckets(samples: dict, name: str) -> list[tuple[float, float]]:
    key = P + name + "_bucket"
    return sorted((float(dict(k)["le"]), v) for (n, k), v in samples.items() if n == key)


async def test_collector_renders_the_stats():
    stats = fixed_stats()
    handler = build_metrics_handler(fleet_of((NAME, StubEngine(stats))))
    no_engine = build_metrics_handler(fleet_of())  # restarting: the process' gauge
    app = Starlette(routes=[Route("/metrics", handler), Route("/empty", no_engine)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/metrics")
        empty = await client.get("/empty")
    assert empty.status_code == 200 and parse(empty.text) == {}
    assert "event_loop_tasks" in empty.text
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    s = parse(response.text)
    assert value(s, "num_requests_running") == 3 and value(s, "num_requests_waiting") == 2
    assert value(s, "kv_cache_usage_perc") == 0.25 and value(s, "prefix_cache_hit_rate") == 0.25
    assert value(s, "prompt_tokens_total") == 11 and value(s, "generation_tokens_total") == 4
    assert value(s, "num_preemptions_total") == 4
    assert {
        r: value(s, "request_success_total", finished_reason=r)
        for r in ("stop", "length", "abort", "error")
    } == stats.num_finished
    for name, snap, bounds in [
        ("time_to_first_token_seconds", stats.time_to_first_token, TTFT_BUCKETS),
        ("inter_token_latency_seconds", stats.inter_token_latency, ITL_BUCKETS),
        ("e2e_request_latency_seconds", stats.e2e_request_latency, E2E_BUCKETS),
    ]:
        assert buckets(s, name) == snap.cumulative_buckets()
        assert [b for b, _ in buckets(s, name)][:-1] == list(bounds)
        assert value(s, name + "_count") == snap.count
        assert value(s, name + "_sum") == pytest.approx(snap.sum)
    assert value(s, "inter_token_latency_seconds_count") == 3
    assert buckets(s, "inter_token_latency_seconds")[0] == (0.01, 2)  # the two zero gaps
    assert buckets(s, "e2e_request_latency_seconds")[-2:] == [(7680.0, 2), (float("inf"), 2)]


def fleet_of(*engines: tuple[str, StubEngine]) -> Any:
    """What build_metrics_handler reads of a ModelFleet: its running engines."""
    return SimpleNamespace(running=lambda: [ServedModel(name, engine) for name, engine in engines])


async def test_each_model_is_one_sample_of_each_family():
    """Two models: every family once (one HELP and TYPE), a sample per model_name."""
    busy = dataclasses.replace(fixed_stats(), num_running=7)
    handler = build_metrics_handler(
        fleet_of(("a", StubEngine(fixed_stats())), ("b", StubEngine(busy)))
    )
    app = Starlette(routes=[Route("/metrics", handler)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        text = (await client.get("/metrics")).text
    assert text.count("# TYPE loomllm:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {
        s.labels["model_name"]: s.value for s in families[P + "num_requests_running"].samples
    }
    assert running == {"a": 3, "b": 7}
    finished = families[P + "request_success"].samples
    assert {s.labels["model_name"] for s in finished} == {"a", "b"}
    ttft = families[P + "time_to_first_token_seconds"].samples
    assert {s.labels["model_name"] for s in ttft if s.name.endswith("_count")} == {"a", "b"}


async def test_loop_task_count_follows_the_tasks():
    before = count_loop_tasks()
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(anyio.sleep_forever)
        await anyio.sleep(0.01)
        assert count_loop_tasks() == before + 5
        tg.cancel_scope.cancel()
    assert count_loop_tasks() == before


@asynccontextmanager
async def served(model: str, manager, api_key: str):
    """test_server's (engine, client) with the API key on, the client sending it."""
    async with running(model, manager, api_key=api_key) as (engine, client):
        client.headers["Authorization"] = f"Bearer {api_key}"
        yield engine, client


async def scrape(client: httpx.AsyncClient) -> dict:
    response = await client.get("/metrics", headers={"Authorization": ""})  # needs no key
    assert response.status_code == 200, response.text
    return parse(response.text)


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 7,
        **extra,
    }


async def streamed_usage(client: httpx.AsyncClient, payload: dict) -> dict:
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200
        chunks = [
            json.loads(line[6:])
            async for line in response.aiter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    return chunks[-1]["usage"]


async def test_served_counters_match_the_usage(tiny_model, shared_manager):
    async with served(tiny_model, shared_manager, "secret") as (engine, client):
        refused = await client.get("/v1/models", headers={"Authorization": ""})
        assert refused.status_code == 401  # the key is on, yet /metrics is open
        s = await scrape(client)
        assert value(s, "prompt_tokens_total") == 0
        assert value(s, "e2e_request_latency_seconds_count") == 0

        # (prompt, max_tokens, n, stream): every sequence runs to max_tokens (ignore_eos).
        plan = [
            ("w1 w2 w3", 5, 1, False),
            ("w4 w5 w6 w7 w8", 3, 2, False),
            ("w9 w10", 4, 2, True),
            ("w11 w12 w13 w14", 6, 1, True),
        ]
        usages = []
        for prompt, max_tokens, n, stream in plan:
            payload = body(prompt, max_tokens, n=n)
            if stream:
                usages.append(await streamed_usage(client, payload))
            else:
                response = await client.post("/v1/completions", json=payload)
                assert response.status_code == 200, response.text
                usages.append(response.json()["usage"])
        await engine.wait_until_idle()
        num_sequences = sum(n for _, _, n, _ in plan)
        prompt_tokens = sum(u["prompt_tokens"] for u in usages)
        generated = sum(u["completion_tokens"] for u in usages)
        assert generated == sum(m * n for _, m, n, _ in plan)
        assert prompt_tokens == 3 + 5 + 2 + 4  # once per request, whatever n

        s = await scrape(client)
        assert value(s, "prompt_tokens_total") == prompt_tokens
        assert value(s, "generation_tokens_total") == generated
        assert value(s, "request_success_total", finished_reason="length") == num_sequences
        assert value(s, "request_success_total", finished_reason="abort") == 0
        # Per sequence: one first token and one end each, a gap between every two tokens.
        assert value(s, "time_to_first_token_seconds_count") == num_sequences
        assert value(s, "e2e_request_latency_seconds_count") == num_sequences
        assert value(s, "inter_token_latency_seconds_count") == generated - num_sequences
        assert value(s, "inter_token_latency_seconds_sum") > 0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert value(s, name) == 0, name

        # A long stream in flight is running and holds KV; hanging up aborts it.
        payload = json.dumps(body("w20 w21", engine.max_model_len - 2, stream=True)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer secret\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        # A raw socket: an httpx stream left early leaks an async generator under trio.
        async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
            await conn.send(head + payload)
            received = b""
            while b"data: " not in received:  # its first token is out
                received += await conn.receive()
            during = await scrape(client)
        assert value(during, "num_requests_running") >= 1
        assert value(during, "kv_cache_usage_perc") > 0
        with anyio.fail_after(20):
            await engine.wait_until_idle()
        after = await scrape(client)
        assert value(after, "request_success_total", finished_reason="abort") == 1
        assert value(after, "prompt_tokens_total") == prompt_tokens + 2
        new_tokens = value(after, "generation_tokens_total") - generated
        assert 1 <= new_tokens < engine.max_model_len - 2
        assert value(after, "inter_token_latency_seconds_count") == (
            generated - num_sequences + new_tokens - 1
        )
        assert value(after, "e2e_request_latency_seconds_count") == num_sequences + 1
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert value(after, name) == 0, name


async def test_speculation_counters_are_vllms():
    stats = dataclasses.replace(
        fixed_stats(),
        spec_num_drafts=4,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=5,
        spec_accepted_per_pos=(3, 2, 0),
    )
    app = Starlette(
        routes=[Route("/m", build_metrics_handler(fleet_of((NAME, StubEngine(stats)))))]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        s = parse((await client.get("/m")).text)
    assert value(s, "spec_decode_num_drafts_total") == 4
    assert value(s, "spec_decode_num_draft_tokens_total") == 12
    assert value(s, "spec_decode_num_accepted_tokens_total") == 5
    per_pos = [
        value(s, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)
    ]
    assert per_pos == [3, 2, 0]
