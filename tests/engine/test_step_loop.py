"""EngineCore's step loop against an in-process worker: when outputs stream, and what it costs.

With async scheduling a step's outputs are streamed only after the next step is sent, so
the time between a reply and the next send holds no output work; without it, right away. A
stop string is then seen one step later: the request computes two dropped tokens, not one,
and its blocks still come back. Held outputs are streamed before an abort applies: none
reaches a new request that took the aborted one's id.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest
from support.fake_worker import FakeWorker
from support.models import save_tiny_tokenizer

from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.engine.core import EngineCore
from loomllm.engine.output_processor import OutputProcessor, ParentRequest
from loomllm.outputs import RequestMetrics, RequestOutput, RequestOutputCollector
from loomllm.protocols.messages import ExecuteStep, StepResult
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams
from loomllm.text.tokenizer import Tokenizer

CUMULATIVE, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY

MAX_MODEL_LEN = 64
PROMPT = [5, 6, 7]


class InProcessWorkers:
    """WorkerClient's submit/collect/discard over test_scheduler's FakeWorker: each step is
    executed as it is sent; `sent` lists the step ids in order. `on_sent()` and
    `on_collect()`, if set, run inside those awaits (as another task of the loop would)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.worker = FakeWorker(config.block_size, config.num_blocks)
        self.sent: list[int] = []
        self.results: dict[int, StepResult] = {}
        self.sampled: dict[str, int] = {}  # tokens sampled per request, dropped ones too
        # Per step sent: (its requests, the steps still in flight as it went out)
        self.depths: list[tuple[int, int]] = []
        self.on_sent: Callable[[], None] | None = None
        self.on_collect: Callable[[], None] | None = None

    async def submit(self, make, on_encoded=None) -> int:
        call_id = len(self.sent)
        step = make(call_id)
        assert isinstance(step, ExecuteStep)
        if on_encoded is not None:
            on_encoded()
        self.sent.append(step.scheduler_output.step_id)
        self.depths.append((len(step.scheduler_output.num_scheduled_tokens), len(self.results)))
        result = self.worker.execute(step.scheduler_output)
        for req_id in result.req_ids:
            self.sampled[req_id] = self.sampled.get(req_id, 0) + 1
        self.results[call_id] = result
        await anyio.lowlevel.checkpoint()
        if self.on_sent is not None:
            self.on_sent()
        return call_id

    async def collect(self, call_id: int) -> list[StepResult]:
        await anyio.lowlevel.checkpoint()
        if self.on_collect is not None:
            self.on_collect()
        return [self.results.pop(call_id)]

    def discard(self, call_id: int) -> None:
        self.results.pop(call_id, None)


def make_core(
    tmp_path, async_scheduling: bool, ahead_max_rows: int | None = None
) -> tuple[EngineCore, InProcessWorkers]:
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        num_blocks=32,
    )
    workers = InProcessWorkers(config)
    core = EngineCore(
        Scheduler(config),
        workers,
        OutputProcessor(Tokenizer.from_model_dir(tmp_path)),
        frozenset(),
        MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
        ahead_max_rows=ahead_max_rows,
    )
    return core, workers


def add(
    core: EngineCore, prompt: list[int], params: SamplingParams, req_id: str = "r"
) -> RequestOutputCollector:
    collector = RequestOutputCollector(params.output_kind)
    core.add_request(
        ParentRequest(req_id, None, prompt, params, collector, RequestMetrics(time.time()))
    )
    return collector


async def last_output(collector: RequestOutputCollector) -> RequestOutput:
    while not (out := await collector.get()).finished:
        pass
    return out


async def run_one(
    tmp_path, params: SamplingParams, async_scheduling: bool
) -> tuple[list[tuple[int, int]], RequestOutput, InProcessWorkers, Scheduler]:
    """One request through an EngineCore: (tokens in each output, the last step sent when it
    was put in the stream), the last output, the workers and the scheduler."""
    core, workers = make_core(tmp_path, async_scheduling)
    collector = RequestOutputCollector(params.output_kind)
    seen: list[tuple[int, int]] = []
    put = collector.put

    def recording_put(output: RequestOutput) -> None:
        seen.append((len(output.outputs[0].token_ids), workers.sent[-1]))
        put(output)

    collector.put = recording_put  # type: ignore[method-assign]
    parent = ParentRequest("r", None, PROMPT, params, collector, RequestMetrics(time.time()))
    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run)
        core.add_request(parent)
        with anyio.fail_after(10):
            while not (last := await collector.get()).finished:
                pass
            await core.wait_until_idle()
        tg.cancel_scope.cancel()
    return seen, last, workers, core.scheduler


@pytest.mark.anyio
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_outputs_stream_after_the_next_step_is_sent(
    tmp_path, anyio_backend, async_scheduling
):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seen, last, workers, _ = await run_one(tmp_path, params, async_scheduling)
    # One prefill step samples the first token; step k samples token k + 1.
    assert [n for n, _ in seen] == list(range(1, 9))
    # Eight steps sample, and no token is dropped; the one after them tells the worker the
    # request finished.
    assert workers.sent[:8] == list(range(8)) and workers.sampled["r"] == 8
    ahead = 2 if async_scheduling else 0
    # Streamed when the step after the one in flight is out (async), or before anything more
    # is sent (sync); the last steps have nothing behind them.
    assert [step for _, step in seen] == [min(n - 1 + ahead, 7) for n in range(1, 9)]
    assert last.outputs[0].finish_reason == "length"


@pytest.mark.anyio
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_a_stop_string_seen_late_costs_two_dropped_tokens(
    tmp_path, anyio_backend, async_scheduling
):
    free = SamplingParams(max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    _, reference, _, _ = await run_one(tmp_path, free, async_scheduling=False)
    tokens = reference.outputs[0].token_ids
    stop = f"w{tokens[2]}"
    assert stop not in reference.outputs[0].text.split()[:2]  # the third token is its first
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop])
    _, last, workers, scheduler = await run_one(tmp_path, params, async_scheduling)
    out = last.outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[:3], "stop", stop)
    assert workers.sampled["r"] == 3 + (2 if async_scheduling else 0)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not scheduler.requests and not workers.results


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["abort", "abort_all"])
async def test_held_outputs_never_reach_a_request_that_took_the_id(tmp_path, anyio_backend, how):
    """Async scheduling holds a step's outputs while the next step goes out: an abort (a
    consumer that left, or abort_all) and a new request under the same id may come in then."""
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    alone, _ = make_core(tmp_path, async_scheduling=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(alone.run)
        expected = (await last_output(add(alone, [9, 9, 9, 9, 9], short))).outputs[0].token_ids
        tg.cancel_scope.cancel()

    core, workers = make_core(tmp_path, async_scheduling=True)
    new: list[RequestOutputCollector] = []
    added = anyio.Event()

    def retry() -> None:  # inside a send: the old request's last results are still held
        if len(workers.sent) == 4 and not new:
            if how == "abort_all":
                core.abort_all()
            assert "r" not in core.output_processor.parents  # the id is free
            new.append(add(core, [9, 9, 9, 9, 9], short))
            added.set()

    if how == "abort":  # the consumer leaves while a step is out: applied next turn
        workers.on_collect = lambda: len(workers.sent) == 3 and core.abort("r")
    workers.on_sent = retry
    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run)
        old = add(core, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
        with anyio.fail_after(10):
            ended = await last_output(old)
            assert ended.outputs[0].finish_reason == "abort"
            await added.wait()
            assert (await last_output(new[0])).outputs[0].token_ids == expected
            await core.wait_until_idle()
        tg.cancel_scope.cancel()
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


async def run_two(
    core: EngineCore,
    workers: InProcessWorkers,
    kinds: tuple[RequestOutputKind, RequestOutputKind] = (CUMULATIVE, CUMULATIVE),
) -> list[list[int]]:
    """A 3-token and a 9-token request added together, their outputs of these kinds: each
    one's tokens."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run)
        short_params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind=kinds[0])
        long_params = SamplingParams(max_tokens=9, ignore_eos=True, output_kind=kinds[1])
        short = add(core, PROMPT, short_params, "short")
        long = add(core, [8, 9], long_params, "long")
        with anyio.fail_after(10):
            tokens = [(await last_output(c)).outputs[0].token_ids for c in (short, long)]
            await core.wait_until_idle()
        tg.cancel_scope.cancel()
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not workers.results
    return tokens


@pytest.mark.anyio
async def test_with_a_row_limit_only_small_steps_run_ahead(tmp_path, anyio_backend):
    """ahead_max_rows=1 (a CPU worker's default): while both requests run, each step goes
    out alone; once the long one runs alone, the next step goes out while one is in flight.
    Tokens are those of the loop without async scheduling."""
    reference = await run_two(*make_core(tmp_path, async_scheduling=False))
    core, workers = make_core(tmp_path, async_scheduling=True, ahead_max_rows=1)
    assert await run_two(core, workers) == reference
    # Each step's (requests, steps in flight as it went out): the prefill and two decodes of
    # both alone; then the long one's decodes, the first alone and the rest one ahead; last,
    # a step that only tells the worker the long one finished.
    assert workers.depths == [(2, 0)] * 3 + [(1, 0)] + [(1, 1)] * 5 + [(0, 0)]

    # Without the limit, every step after the first went out with one in flight.
    unlimited, workers = make_core(tmp_path, async_scheduling=True)
    assert await run_two(unlimited, workers) == reference
    assert [in_flight for _, in_flight in workers.depths][1:-1] == [1] * (len(workers.depths) - 2)


@pytest.mark.anyio
async def test_with_a_row_limit_steps_of_whole_outputs_alone_run_ahead(tmp_path, anyio_backend):
    """ahead_max_rows=1, but both requests' outputs whole (FINAL_ONLY, LLM.generate's):
    nothing is streamed between steps, so every step after the first goes out while one is
    in flight. One request streaming its tokens keeps the steps of both alone."""
    reference = await run_two(*make_core(tmp_path, async_scheduling=False))
    core, workers = make_core(tmp_path, async_scheduling=True, ahead_max_rows=1)
    assert await run_two(core, workers, (FINAL_ONLY, FINAL_ONLY)) == reference
    assert [in_flight for _, in_flight in workers.depths][1:-1] == [1] * (len(workers.depths) - 2)

    core, workers = make_core(tmp_path, async_scheduling=True, ahead_max_rows=1)
    assert await run_two(core, workers, (FINAL_ONLY, CUMULATIVE)) == reference
    assert workers.depths == [(2, 0)] * 3 + [(1, 0)] + [(1, 1)] * 5 + [(0, 0)]
