"""Many models behind one server (ModelFleet): loading on demand, LRU eviction under
max_loaded, keep_alive, a busy model kept, a dead worker failing only its own model, and the
routes' view of it all (/v1/models, /api/ps, /metrics, 404s)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from support.models import make_tiny_model
from support.processes import wait_gone

from loomllm.clients.manager import list_workers
from loomllm.server import build_app, serve
from loomllm.server.fleet.catalog import ModelEntry
from loomllm.server.fleet.fleet import ModelFleet

pytestmark = pytest.mark.anyio

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def three_models(tmp_path_factory) -> dict[str, str]:
    """Three tiny llamas with different random weights: their answers tell them apart."""
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(f"fleet-{name}"), seed=seed)
        for seed, name in enumerate(["a", "b", "c"], start=11)
    }


def served(models: dict[str, str], manager, names: str, **options) -> list[ModelEntry]:
    """`names` served from `models`, on fp32, each with workers of its own (its max_num_seqs
    is no other test's), so that an unload stops nobody else's warm worker."""
    return [
        ModelEntry(
            name,
            models[name],
            {
                "manager_socket": manager.socket,
                "dtype": "float32",
                "max_num_seqs": 40 + i,
                **options,
            },
        )
        for i, name in enumerate(names)
    ]


@asynccontextmanager
async def fleet_server(fleet: ModelFleet) -> AsyncIterator[httpx.AsyncClient]:
    """The fleet running and served on a free port; a client for it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        try:
            async with anyio.create_task_group() as server:
                server.start_soon(serve, build_app(fleet), f"fd://{sock.detach()}", stop.wait)
                base = f"http://127.0.0.1:{port}"
                try:
                    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                        with anyio.fail_after(10):
                            while True:
                                try:
                                    await client.get("/version")
                                    break
                                except httpx.ConnectError:
                                    await anyio.sleep(0.02)
                        yield client
                finally:
                    stop.set()  # the server ends first, gracefully, then the fleet
        finally:
            tg.cancel_scope.cancel()


async def complete(client: httpx.AsyncClient, model: str) -> str:
    """The model's greedy text for a fixed prompt (the name it answered under checked)."""
    body = {"model": model, "prompt": "w5 w6 w7", **GREEDY}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model.removesuffix(":latest")
    return answer.json()["choices"][0]["text"]


async def gone(pid: int) -> bool:
    """Whether the process `pid` exits within 15 s (waited for off the event loop)."""
    return await anyio.to_thread.run_sync(wait_gone, pid, 15)


async def loaded_names(client: httpx.AsyncClient) -> list[str]:
    """/api/ps's models, most recently used first."""
    return [m["name"] for m in (await client.get("/api/ps")).json()["models"]]


async def until_unloaded(client: httpx.AsyncClient, name: str) -> None:
    """Poll /api/ps, as a client would: the fleet unloads in a task of its own."""
    with anyio.fail_after(10):
        while name in await loaded_names(client):  # noqa: ASYNC110
            await anyio.sleep(0.1)


def worker_pids(fleet: ModelFleet) -> dict[str, int]:
    return {s.name: s.engine.worker_pids[0] for s in fleet.running()}


async def manager_models(manager) -> set[str]:
    """The models the engine-manager runs workers for, as `engine-manager ps` lists them."""
    return {info.model for info in await list_workers(Path(manager.socket))}


async def test_models_load_on_demand_and_the_least_recently_used_is_evicted(
    three_models, shared_manager
):
    fleet = ModelFleet(served(three_models, shared_manager, "abc"), max_loaded=2)
    async with fleet_server(fleet) as client:
        # The first two load at the start, up to the cap; the third waits for a request.
        assert sorted(await loaded_names(client)) == ["a", "b"]
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["loaded"]) for m in listed] == [("a", True), ("b", True), ("c", False)]
        assert "max_model_len" not in listed[2]
        first = {name: await complete(client, name) for name in "ba"}  # a used last
        assert first["a"] != first["b"]
        pids = worker_pids(fleet)

        first["c"] = await complete(client, "c")  # loads c; b, the least recently used, goes
        assert await loaded_names(client) == ["c", "a"]
        assert await gone(pids["b"])  # its workers stopped, memory freed
        assert three_models["b"] not in await manager_models(shared_manager)
        assert {three_models["a"], three_models["c"]} <= await manager_models(shared_manager)

        assert await complete(client, "b") == first["b"]  # reloaded, the same model; a goes
        assert await loaded_names(client) == ["b", "c"]
        assert await gone(pids["a"])
        metrics = (await client.get("/metrics")).text
        assert 'model_name="b"' in metrics and 'model_name="c"' in metrics
        assert 'model_name="a"' not in metrics


async def test_a_busy_model_is_not_evicted_until_its_requests_end(three_models, shared_manager):
    fleet = ModelFleet(served(three_models, shared_manager, "ab"), max_loaded=1)
    async with fleet_server(fleet) as client:
        b_loaded = anyio.Event()

        async def ask_b() -> None:
            await complete(client, "b")
            b_loaded.set()

        async with anyio.create_task_group() as tg, fleet.use("a"):  # a request in a
            tg.start_soon(ask_b)
            await anyio.sleep(1.0)
            assert not b_loaded.is_set() and await loaded_names(client) == ["a"]
        await b_loaded.wait()  # a's request ended: a went, b came
        assert await loaded_names(client) == ["b"]


async def test_an_idle_model_is_unloaded_after_its_keep_alive(three_models, shared_manager):
    fleet = ModelFleet(served(three_models, shared_manager, "a"), keep_alive=0.5)
    fleet.models["b"] = ModelEntry(  # as a cached hub model is: loaded on demand
        "b", three_models["b"], served(three_models, shared_manager, "ab")[1].options, False
    )
    async with fleet_server(fleet) as client:
        await complete(client, "b")
        pid = worker_pids(fleet)["b"]
        ps = (await client.get("/api/ps")).json()["models"]
        expiry = {m["name"]: m["expires_at"] for m in ps}
        assert expiry["a"].startswith("2318")  # named at start: kept until evicted
        assert not expiry["b"].startswith("2318")
        await until_unloaded(client, "b")
        assert await gone(pid)
        assert await loaded_names(client) == ["a"]
        # Ollama's keep_alive 0 on a request: unloaded as soon as it is idle.
        answer = await client.post(
            "/api/generate",
            json={"model": "b", "prompt": "w5", "stream": False, "keep_alive": 0},
        )
        assert answer.status_code == 200, answer.text
        await until_unloaded(client, "b")


async def test_unknown_models_and_bad_keep_alive_are_refused_and_the_server_serves_on(
    three_models, shared_manager
):
    fleet = ModelFleet(served(three_models, shared_manager, "ab"))
    async with fleet_server(fleet) as client:
        answer = await client.post("/v1/completions", json={"model": "zz", "prompt": "w5"})
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["param"] == "model" and "'zz'" in error["message"]
        assert "'a', 'b'" in error["message"]  # what the server has
        ollama = await client.post("/api/chat", json={"model": "zz:latest", "messages": []})
        assert ollama.status_code == 404 and "zz" in ollama.json()["error"]
        bad = await client.post(
            "/api/generate", json={"model": "a", "prompt": "w5", "keep_alive": "5 minutes"}
        )
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
        assert await complete(client, "a") and await complete(client, "b:latest")
        default = await client.post("/v1/completions", json={"prompt": "w5", **GREEDY})
        assert default.json()["model"] == "a"  # no model: the first one


@pytest.mark.serial  # a killed worker and its replacement
async def test_a_dead_worker_fails_only_its_own_model_which_restarts(three_models, shared_manager):
    fleet = ModelFleet(served(three_models, shared_manager, "ab", block_size=8))
    async with fleet_server(fleet) as client:
        before = {name: await complete(client, name) for name in "ab"}
        a_engine = next(s.engine for s in fleet.running() if s.name == "a")
        os.kill(a_engine.worker_pids[0], signal.SIGKILL)
        assert await complete(client, "b") == before["b"]  # b serves on meanwhile
        with anyio.fail_after(60):
            while True:
                engine = next((s.engine for s in fleet.running() if s.name == "a"), None)
                if engine is not None and engine is not a_engine:
                    break
                await anyio.sleep(0.1)
        assert await complete(client, "a") == before["a"]
        assert not fleet.failed.is_set()
