"""Load on a real `loom serve`: rounds of 1,000 requests at concurrency 200 (completions and
chat, streaming or not, some n=2), every answer complete and well-formed, none lost; the
RSS of the server and of its worker stays flat from one round to the next.
"""

from __future__ import annotations

import json
import random
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from serve_utils import loom_serve, rss_bytes

NAME = "tiny"
NUM_REQUESTS = 1000
CONCURRENCY = 200
ROUND_S = 60  # a round takes ~8 s on 2 cores; past this something hangs
RSS_SLACK_MIB = 8  # allocator arenas and caches settle in steps this size


@dataclass(frozen=True, slots=True)
class Spec:
    chat: bool
    stream: bool
    words: int
    max_tokens: int
    n: int

    def body(self, i: int) -> dict[str, Any]:
        text = " ".join(f"w{(i + k) % 200 + 20}" for k in range(self.words))
        body: dict[str, Any] = {
            "model": NAME,
            "max_tokens": self.max_tokens,
            "n": self.n,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            return {**body, "messages": [{"role": "user", "content": text}]}
        return {**body, "prompt": text}

    @property
    def prompt_tokens(self) -> int:
        return self.words + 2 if self.chat else self.words  # the template adds two words


def specs(seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [
        Spec(
            chat=rng.random() < 0.1,
            stream=rng.random() < 0.5,
            words=rng.randint(1, 8),
            max_tokens=rng.randint(1, 8),
            n=2 if rng.random() < 0.1 else 1,
        )
        for _ in range(NUM_REQUESTS)
    ]


def check_whole(spec: Spec, body: dict[str, Any]) -> str:
    """The checked body's id."""
    assert body["object"] == ("chat.completion" if spec.chat else "text_completion"), body
    choices = body["choices"]
    assert sorted(c["index"] for c in choices) == list(range(spec.n)), body
    assert all(c["finish_reason"] == "length" for c in choices), body
    for c in choices:
        text = c["message"]["content"] if spec.chat else c["text"]
        assert len(text.split()) == spec.max_tokens, body  # one word per token, none special
    assert body["usage"] == {
        "prompt_tokens": spec.prompt_tokens,
        "completion_tokens": spec.max_tokens * spec.n,
        "total_tokens": spec.prompt_tokens + spec.max_tokens * spec.n,
    }
    return body["id"]


def check_stream(spec: Spec, raw: str) -> str:
    """The checked stream's id: `data:` events, [DONE] once and last, usage just before it."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), raw[-400:]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, raw[-400:]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    *deltas, last = chunks
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == spec.max_tokens * (spec.n)
        and last["usage"]["prompt_tokens"] == spec.prompt_tokens
    ), last
    assert len({c["id"] for c in chunks}) == 1
    kind = "chat.completion.chunk" if spec.chat else "text_completion"
    assert all(c["object"] == kind for c in chunks)
    texts: dict[int, str] = {i: "" for i in range(spec.n)}
    finish: dict[int, str] = {}
    for c in deltas:
        (choice,) = c["choices"]
        assert choice["index"] not in finish, "nothing after a choice's finish_reason"
        texts[choice["index"]] += (
            (choice["delta"].get("content") or "") if spec.chat else (choice["text"])
        )
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert finish == {i: "length" for i in range(spec.n)}, finish
    assert all(len(t.split()) == spec.max_tokens for t in texts.values()), texts
    return chunks[0]["id"]


async def one_round(lanes: list[httpx.AsyncClient], seed: int, num: int = NUM_REQUESTS) -> dict:
    """`num` requests, one lane (one client, one connection) per concurrent request: the
    counts of what came back, the ids of the good answers, what was wrong with the others."""
    todo = list(enumerate(specs(seed)[:num]))
    ids: list[str] = []
    failures: list[str] = []

    async def one(client: httpx.AsyncClient, i: int, spec: Spec) -> None:
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        try:
            async with client.stream("POST", path, json=spec.body(i)) as response:
                raw = (await response.aread()).decode()
            assert response.status_code == 200, raw[:300]
            ids.append(
                check_stream(spec, raw) if spec.stream else check_whole(spec, json.loads(raw))
            )
        except Exception as exc:  # collected: one failure must not hide the others
            failures.append(f"request {i} {spec}: {exc!r}"[:600])

    async def lane(client: httpx.AsyncClient) -> None:
        while todo:
            await one(client, *todo.pop())

    start = time.monotonic()
    with anyio.fail_after(ROUND_S):
        async with anyio.create_task_group() as tg:
            for client in lanes:
                tg.start_soon(lane, client)
    return {
        "sent": num,
        "ok": len(ids),
        "unique_ids": len(set(ids)),
        "failed": len(failures),
        "wall_s": round(time.monotonic() - start, 1),
        "ids": ids,
        "failures": failures,
    }


@asynccontextmanager
async def lane_clients(
    base_url: str, num: int, request_s: float
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """`num` clients of one connection each: httpx's pool slows down past a few dozen
    connections (the test client, not the server, would set the pace). They drop a
    connection idle for 2 s, before the server's 5 s keep-alive timeout can close it under
    a request being sent.
    """
    tls = ssl.create_default_context()  # never used (http://), but costly to make per client
    limits = httpx.Limits(max_connections=1, keepalive_expiry=2)
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=base_url, limits=limits, timeout=request_s, verify=tls)
            )
            for _ in range(num)
        ]


def mib(n: int) -> float:
    return round(n / 2**20, 1)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_1000_requests_at_concurrency_200_none_lost_rss_flat(
    chat_model, shared_manager, anyio_backend, record_property
):
    busy_before = {p for p, s in shared_manager.worker_states().items() if s == "busy"}
    with loom_serve(chat_model, shared_manager.socket, NAME) as server:
        (worker,) = {
            p for p, s in shared_manager.worker_states().items() if s == "busy"
        } - busy_before
        rss: dict[str, list[float]] = {"server_rss_mib": [], "worker_rss_mib": []}
        rounds = []
        async with lane_clients(server.base_url, CONCURRENCY, ROUND_S) as lanes:
            warm = await one_round(lanes, seed=0, num=CONCURRENCY)  # arenas, pools, caches
            for seed in (None, 1, 2):
                if seed is not None:
                    rounds.append(await one_round(lanes, seed))
                rss["server_rss_mib"].append(mib(rss_bytes(server.pid)))
                rss["worker_rss_mib"].append(mib(rss_bytes(worker)))
    summary = [{k: v for k, v in r.items() if k not in ("failures", "ids")} for r in rounds]
    print(f"\nload rounds: {json.dumps(summary)}; RSS after warm-up, round 1, round 2: {rss}")
    record_property("load_rounds", summary)
    for name, values in rss.items():
        record_property(name, values)
    for r in [warm, *rounds]:
        assert not r["failures"], f"{r['failed']} failed:\n" + "\n".join(r["failures"][:10])
    all_ids = [i for r in rounds for i in r["ids"]]
    assert len(set(all_ids)) == len(all_ids) == 2 * NUM_REQUESTS  # none lost, none repeated
    for who, (_, first, second) in rss.items():
        assert abs(second - first) <= first * 0.10 + RSS_SLACK_MIB, (who, first, second)
