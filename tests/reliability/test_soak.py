"""Soak: random traffic against a real `loom serve` for LOOM_SOAK_SECONDS (8 s in `make test`,
300 in `make soak`): requests that finish, streams the client leaves early, requests cancelled
while waiting, connections dropped before or during the body, bad bodies. Every request ends
as planned; afterwards nothing leaks: no KV block, no queued request, no event-loop task
(the server's /metrics counts them), no fd, no process, no thread, no memory (RSS within 10%).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.load import RSS_SLACK_MIB, Spec, check_stream, check_whole, lane_clients, mib
from support.servers import LoomServer, loom_serve, rss_bytes

NAME = "tiny"
SECONDS = float(os.environ.get("LOOM_SOAK_SECONDS", "8"))
SEED = int(os.environ.get("LOOM_SOAK_SEED", "0"))
LANES = 24
IDLE_S = 10  # for the engine to drain and the server to close its sockets after the traffic
REQUEST_S = 30  # no single request may take longer
FD_SLACK = 4  # e.g. a connection hypercorn has not closed yet at the last look
TASK_SLACK = 4  # likewise: a connection's tasks


def long_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    """A request that runs for a while (hundreds of tokens): there is time to leave it."""
    return {
        "model": NAME,
        "prompt": f"w{rng.randint(5, 250)} w7",
        "n": rng.randint(1, 2),
        "max_tokens": rng.randint(100, 400),
        "ignore_eos": True,
        "stream": stream,
    }


async def finish(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    spec = Spec(
        chat=rng.random() < 0.2,
        stream=rng.random() < 0.5,
        words=rng.randint(1, 8),
        max_tokens=rng.randint(1, 16),
        n=rng.randint(1, 3),
    )
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    response = await client.post(path, json=spec.body(i))
    assert response.status_code == 200, response.text[:300]
    if spec.stream:
        check_stream(spec, response.text)
    else:
        check_whole(spec, response.json())
    return "finished"


async def leave_stream(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """Read a few events of a long stream, then close it (httpx drops the connection)."""
    wanted = rng.randint(1, 5)
    async with client.stream("POST", "/v1/completions", json=long_body(rng, True)) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            assert line != "data: [DONE]", "a long stream ended before we left it"
            seen += line.startswith("data: ")
            if seen == wanted:
                return "left stream"
    raise AssertionError("the stream ended without [DONE]")


async def cancel_waiting(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """A long non-streaming request, cancelled while the client waits for its answer."""
    with anyio.move_on_after(rng.uniform(0, 0.2)):
        response = await client.post("/v1/completions", json=long_body(rng, False))
        assert response.status_code == 200  # it was quicker than our patience: fine
        return "finished"
    return "cancelled"


async def hang_up(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """Over a raw socket: send the whole request, wait a moment (maybe for the first bytes of
    the answer), close."""
    data = json.dumps(long_body(rng, rng.random() < 0.5)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
        await conn.send(head + data)
        with anyio.move_on_after(rng.uniform(0, 0.2)):
            await conn.receive()
    return "hung up"


async def cut_body(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """Over a raw socket: promise a body, send part of it, close."""
    data = json.dumps(long_body(rng, False)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    async with await anyio.connect_tcp("127.0.0.1", client.base_url.port) as conn:
        await conn.send(head + data[: rng.randint(0, len(data) - 1)])
    return "cut body"


async def bad_body(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    body = rng.choice(
        [
            {"prompt": "w5", "temperature": -1},
            {"prompt": []},
            {"messages": []},
            {"prompt": "w5", "n": 0},
            {"model": "other", "prompt": "w5"},
        ]
    )
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await client.post(path, json=body)
    assert response.status_code in (400, 404), response.text[:300]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return "refused"


Action = Callable[[httpx.AsyncClient, random.Random, int], Awaitable[str]]
ACTIONS: list[tuple[float, Action]] = [
    (0.4, finish),
    (0.2, leave_stream),
    (0.1, cancel_waiting),
    (0.15, hang_up),
    (0.05, cut_body),
    (0.1, bad_body),
]


def metrics(scrape: httpx.Client) -> dict[str, float]:
    """/metrics' samples by name (request_success by `name:reason`). One kept-alive connection
    for all scrapes: a new one each time would leave the server a connection's tasks for its
    keep-alive time (hypercorn ends them only then), and the task count would follow the polls."""
    text = scrape.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            samples[s.name.removeprefix("loomllm:") + (f":{reason}" if reason else "")] = s.value
    return samples


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def num_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads for pid {pid}")


async def settle(check: Callable[[], bool], within: float) -> bool:
    """Poll `check` until true or `within` seconds (the server is another process: no event)."""
    with anyio.move_on_after(within):
        while not check():  # noqa: ASYNC110 (no event to wait on)
            await anyio.sleep(0.05)
        return True
    return False


def resources(server: LoomServer, scrape: httpx.Client, worker: int) -> dict[str, float]:
    return {
        "server_tasks": metrics(scrape)["event_loop_tasks"],
        "server_fds": num_fds(server.pid),
        "worker_fds": num_fds(worker),
        "server_threads": num_threads(server.pid),
        "worker_threads": num_threads(worker),
        "server_rss_mib": mib(rss_bytes(server.pid)),
        "worker_rss_mib": mib(rss_bytes(worker)),
    }


async def traffic(server: LoomServer, seconds: float) -> Counter:
    """LANES lanes of random actions until `seconds` have passed; outcomes counted."""
    outcomes: Counter = Counter()
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    weights, actions = zip(*ACTIONS, strict=True)

    async def lane(k: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(SEED * 1000 + k)
        i = 0
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            try:
                with anyio.fail_after(REQUEST_S):
                    outcomes[await action(client, rng, k * 100_000 + i)] += 1
            except Exception as exc:  # collected: one failure must not hide the others
                failures.append(f"lane {k} request {i} {action.__name__}: {exc!r}"[:500])
            i += 1

    async with lane_clients(server.base_url, LANES, REQUEST_S) as clients:
        async with anyio.create_task_group() as tg:
            for k, client in enumerate(clients):
                tg.start_soon(lane, k, client)
    assert not failures, f"{len(failures)} requests went wrong:\n" + "\n".join(failures[:20])
    return outcomes


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_soak_random_cancellations_leak_nothing(
    chat_model, shared_manager, anyio_backend, record_property
):
    busy_before = {p for p, s in shared_manager.worker_states().items() if s == "busy"}
    with (
        loom_serve(chat_model, shared_manager.socket, NAME) as server,
        httpx.Client(base_url=server.base_url) as scrape,
    ):
        fresh_tasks = metrics(scrape)["event_loop_tasks"]  # before any request
        (worker,) = {
            p for p, s in shared_manager.worker_states().items() if s == "busy"
        } - busy_before
        await traffic(server, min(SECONDS, 1.0))  # warm-up: pools, caches, lazy imports
        assert await settle(lambda: metrics(scrape)["num_requests_running"] == 0, IDLE_S)
        before, start_metrics = resources(server, scrape, worker), metrics(scrape)
        processes = set(shared_manager.processes())  # the manager's, its workers, this server
        outcomes = await traffic(server, SECONDS)

        def idle() -> bool:
            m = metrics(scrape)
            return m["num_requests_running"] == m["num_requests_waiting"] == 0 and (
                m["kv_cache_usage_perc"] == 0
            )

        is_idle = await settle(idle, IDLE_S)
        fds_back = await settle(
            lambda: (
                resources(server, scrape, worker)["server_fds"] <= before["server_fds"] + FD_SLACK
            ),
            IDLE_S,
        )
        # Against the fresh server's count: `before` may still hold the warm-up's connections.
        tasks_back = await settle(
            lambda: metrics(scrape)["event_loop_tasks"] <= fresh_tasks + TASK_SLACK, IDLE_S
        )
        after, end_metrics = resources(server, scrape, worker), metrics(scrape)
        processes_after = set(shared_manager.processes())
        log = server.output()
    finished = {
        k: end_metrics[k] - start_metrics.get(k, 0)
        for k in end_metrics
        if k.startswith("request_success_total:")
    }
    print(
        f"\nsoak {SECONDS:g} s, seed {SEED}: {dict(outcomes)}; sequences ended by reason "
        f"{finished}; tasks of the fresh server {fresh_tasks}; before {before}, after {after}"
    )
    record_property("soak_outcomes", dict(outcomes))
    record_property("soak_resources", {"before": before, "after": after})
    assert is_idle, f"the engine did not drain: {end_metrics}"
    assert tasks_back, f"server tasks {fresh_tasks} fresh -> {after['server_tasks']}"
    assert fds_back, f"server fds {before['server_fds']} -> {after['server_fds']}"
    assert after["worker_fds"] <= before["worker_fds"] + FD_SLACK, (before, after)
    for who in ("server_threads", "worker_threads"):
        assert after[who] <= before[who] + 2, (who, before, after)  # a thread pool may grow
    for who in ("server_rss_mib", "worker_rss_mib"):
        assert after[who] <= before[who] * 1.10 + RSS_SLACK_MIB, (who, before, after)
    assert finished.get("request_success_total:error", 0) == 0, finished
    assert finished["request_success_total:abort"] > 0 and outcomes["finished"] > 0
    assert processes_after == processes, "a process came or went"
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
