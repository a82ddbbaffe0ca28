"""Load on a real `loom serve`: rounds of 1,000 requests at concurrency 200 (completions and
chat, streaming or not, some n=2), every answer complete and well-formed, none lost; the
RSS of the server and of its worker stays flat from one round to the next.
"""

from __future__ import annotations

import json
import random
import time

import anyio
import httpx
import pytest
from support.load import NAME, RSS_SLACK_MIB, Spec, check_stream, check_whole, lane_clients, mib
from support.servers import loom_serve, rss_bytes

NUM_REQUESTS = 1000
CONCURRENCY = 200
ROUND_S = 60  # a round takes ~8 s on 2 cores; past this something hangs


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
