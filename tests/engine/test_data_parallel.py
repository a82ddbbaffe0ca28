"""Data parallel: two replicas of a small model behind one Engine and one `loom serve`.

Every request is answered exactly once, with the greedy tokens of one replica, and the
load splits within 60/40; a replica whose worker is killed fails only its own requests
while the other serves on; the stats and /metrics add up and break down per replica.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from support.models import make_tiny_model
from support.servers import loom_serve

from loomllm import Engine, EngineConfig, EngineDeadError, SamplingParams
from loomllm.metrics.counters import HistogramSnapshot
from loomllm.metrics.stats import EngineStats, merge_stats

# Processes that need both cores at once: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

NUM_REQUESTS = 200
CONCURRENCY = 50
PROMPTS = [f"w{5 + k} w{40 + 3 * k} w7" for k in range(10)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


def make_engine(tiny_model, shared_manager, **options) -> Engine:
    # max_num_seqs=17: options of our own, so other tests' warm workers stay theirs.
    return Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        **{"max_num_seqs": 17, **options},
    )


def split_params(k: int) -> SamplingParams:
    """Request k's: 4 to 12 tokens. Requests of one length that start in one step finish in
    one step, and a replica whose whole batch finished takes the next ones in a run; with
    equal lengths the split then hangs on which replica's batch ended last."""
    return SamplingParams(max_tokens=4 + (7 * k) % 9, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def replica_bound_model(tmp_path_factory) -> str:
    """A model whose steps outlast the engine's own work on them. With the tiny model the
    engine's one event loop is the bottleneck: the replica whose replies it reads first
    finishes its requests first and gets the next ones, and the split follows that order
    rather than the router. Wide weights (std 0.2) keep greedy tokens clear of near-ties."""
    return make_tiny_model(
        tmp_path_factory.mktemp("replica-bound"),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        initializer_range=0.2,
    )


async def final_tokens(stream) -> list[int]:
    async for out in stream:
        if out.finished:
            return out.outputs[0].token_ids
    raise AssertionError("stream ended without a finished output")


@pytest.mark.anyio
async def test_200_requests_at_concurrency_50_each_answered_once_split_within_60_40(
    replica_bound_model, shared_manager
):
    longest = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with make_engine(replica_bound_model, shared_manager) as one:
        expected = [await final_tokens(one.generate(p, longest)) for p in PROMPTS]
    answers: Counter[str] = Counter()
    placed: Counter[int] = Counter()
    wrong: list[str] = []
    limit = anyio.Semaphore(CONCURRENCY)

    async def run(k: int, dp: Engine) -> None:
        async with limit:
            request_id = f"r{k}"
            params = split_params(k)
            stream = dp.generate(PROMPTS[k % len(PROMPTS)], params, request_id=request_id)
            placed[dp.replica_index(request_id)] += 1
            async for out in stream:
                if out.finished:
                    answers[request_id] += 1
                    want = expected[k % len(PROMPTS)][: params.max_tokens]
                    if out.outputs[0].token_ids != want:
                        wrong.append(request_id)

    # Batches of 9: a replica's batch that ends together hands it at most 9 requests in a run.
    async with make_engine(
        replica_bound_model, shared_manager, data_parallel_size=2, max_num_seqs=9
    ) as dp:
        assert len(set(dp.worker_pids)) == 2
        async with anyio.create_task_group() as tg:
            for k in range(NUM_REQUESTS):
                tg.start_soon(run, k, dp)
        stats = dp.stats()
    assert answers == Counter({f"r{k}": 1 for k in range(NUM_REQUESTS)})
    assert wrong == []
    assert sorted(placed) == [0, 1] and min(placed.values()) >= 0.4 * NUM_REQUESTS, placed
    # The replicas' own counts agree with where the requests went, and add up.
    finished = [sum(r.num_finished.values()) for r in stats.replicas]
    assert finished == [placed[0], placed[1]]
    assert sum(stats.num_finished.values()) == NUM_REQUESTS
    lengths = sum(split_params(k).max_tokens for k in range(NUM_REQUESTS))
    assert stats.num_generation_tokens == lengths
    assert stats.e2e_request_latency.count == NUM_REQUESTS
    assert stats.num_total_blocks == sum(r.num_total_blocks for r in stats.replicas)


@pytest.mark.anyio
async def test_a_killed_replica_fails_only_its_requests(tiny_model, shared_manager):
    async with make_engine(tiny_model, shared_manager, data_parallel_size=2) as dp:
        ends: dict[str, str] = {}
        flowing = {f"s{k}": anyio.Event() for k in range(6)}

        async def consume(request_id: str) -> None:
            try:
                async for out in dp.generate("w5 w6", LONG, request_id=request_id):
                    flowing[request_id].set()
                    if out.finished:
                        ends[request_id] = "finished"
            except EngineDeadError:
                ends[request_id] = "dead"

        idle = anyio.Event()

        async def wait_idle() -> None:  # from before the death: must not wait for the dead
            with anyio.fail_after(60):
                await dp.wait_until_idle()
            idle.set()

        async with anyio.create_task_group() as tg:
            for request_id in flowing:
                tg.start_soon(consume, request_id)
            with anyio.fail_after(30):
                for event in flowing.values():
                    await event.wait()
            tg.start_soon(wait_idle)
            on = {request_id: dp.replica_index(request_id) for request_id in flowing}
            # Both hold some (how many each depends on when their loops took the first).
            assert set(on.values()) == {0, 1}, on
            os.kill(dp.worker_pids[0], signal.SIGKILL)
        assert ends == {rid: "dead" if on[rid] == 0 else "finished" for rid in flowing}
        assert idle.is_set()
        # The survivor takes every new request.
        for prompt in PROMPTS[:4]:
            assert len(await final_tokens(dp.generate(prompt, GREEDY))) == GREEDY.max_tokens
        # Aborts by id reach the survivor (replica 1, now the only one listed as live).
        stream = dp.generate("w5 w6", LONG, request_id="late")
        assert dp.replica_index("late") == 1
        dp.abort("late")
        outputs = [out async for out in stream]
        assert outputs[-1].outputs[0].finish_reason == "abort"
        stats = dp.stats()
        assert [r.is_alive for r in stats.replicas] == [False, True] and stats.is_alive
        assert stats.replicas[0].num_running == stats.replicas[0].num_waiting == 0
        assert stats.num_finished["error"] == list(on.values()).count(0)


@pytest.mark.anyio
async def test_the_engine_dies_with_its_last_replica(tiny_model, shared_manager):
    with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
        async with make_engine(tiny_model, shared_manager, data_parallel_size=2) as dp:
            for pid in dp.worker_pids:
                os.kill(pid, signal.SIGKILL)
            await anyio.sleep_forever()


def test_loom_serve_with_two_replicas(tiny_model, shared_manager):
    """200 completions at concurrency 50, each answered once; /metrics adds up and breaks
    down by replica; after one replica's worker is killed the server serves on."""
    with loom_serve(
        tiny_model,
        shared_manager.socket,
        "tiny",
        "asyncio",
        "--data-parallel-size",
        "2",
        "--max-num-seqs",
        "19",
    ) as server:
        base = server.base_url
        before = replica_counts(base, "replica_requests_finished")

        def complete(k: int) -> str:
            body = {
                "model": "tiny",
                "prompt": PROMPTS[k % len(PROMPTS)],
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 5
            return reply.json()["id"]

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            ids = list(pool.map(complete, range(NUM_REQUESTS)))
        assert len(set(ids)) == NUM_REQUESTS
        after = replica_counts(base, "replica_requests_finished")
        served = [after[r] - before[r] for r in ("0", "1")]
        assert sum(served) == NUM_REQUESTS and min(served) >= 0.4 * NUM_REQUESTS, served

        # The replicas' two workers: the shared manager lends no other group meanwhile.
        busy = [p for p, state in shared_manager.worker_states().items() if state == "busy"]
        assert len(busy) == 2, busy
        os.kill(busy[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sorted(replica_counts(base, "replica_up").values()) != [0.0, 1.0]:
            assert time.monotonic() < deadline, "the dead replica is still reported up"
            time.sleep(0.05)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        with ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(complete, range(16)))) == 16


def replica_counts(base: str, family: str) -> dict[str, float]:
    """{replica: value} of one `loomllm:<family>` family in /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith(f"loomllm:{family}") and 'replica="' in line:
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = float(line.rsplit(" ", 1)[1])
    return counts


def test_merged_stats_add_up_and_keep_the_breakdown():
    def part(running: int, queries: int, rate: float, alive: bool = True) -> EngineStats:
        hist = HistogramSnapshot((1.0,), (running, 1), 2.5, running + 1)
        return EngineStats(
            running,
            1,
            10,
            20,
            rate,
            5,
            0,
            7,
            9,
            {"stop": running},
            hist,
            hist,
            hist,
            num_prefix_cache_queries=queries,
            is_alive=alive,
        )

    a, b, c = part(2, 300, 0.5), part(4, 100, 0.1), part(8, 0, 0.0, alive=False)
    merged = merge_stats([a, b, c])
    # The queues and blocks of the live ones; the totals of all.
    assert (merged.num_running, merged.num_waiting, merged.num_total_blocks) == (6, 2, 40)
    assert merged.kv_cache_usage == 0.5
    assert merged.prefix_cache_hit_rate == pytest.approx((150 + 10) / 400)
    assert merged.num_finished == {"stop": 14}
    assert merged.time_to_first_token.counts == (14, 3) and merged.e2e_request_latency.sum == 7.5
    assert merged.is_alive and merged.replicas == (a, b, c)
    assert not merge_stats([c, c]).is_alive
    assert merge_stats([a]) is a


def test_each_cuda_rank_gets_a_gpu_of_its_own():
    from loomllm.workers.worker.state import cuda_device_index

    def options(data_parallel_rank: int = 0, **engine_options):
        return EngineConfig("m", **engine_options).worker_spec(data_parallel_rank).options

    dp2_tp2 = options(1, data_parallel_size=2, tensor_parallel_size=2)
    assert [cuda_device_index(dp2_tp2, rank, 2, 4) for rank in (0, 1)] == [2, 3]
    assert cuda_device_index(options(), 1, 2, 2) == 1
    assert cuda_device_index(options(distributed_executor_backend="ray"), 1, 2, 1) == 0
    with pytest.raises(
        ValueError,
        match=r"2 x 2 ranks need 4 GPUs, one each; this machine "
        "has 3",
    ):
        cuda_device_index(dp2_tp2, 0, 2, 3)
