"""Scheduler against a fake worker: budgets, chunked prefill, prefix hits, preemption, stops.

`FakeWorker` keeps the same per-request state as workers/runner/model_runner.py, built only from
the SchedulerOutputs, and a fake KV cache whose every slot records the token prefix it was
computed for: reading a context slot that holds anything else (a wrong block id, a wrong
prefix-cache hit, a block overwritten by another request) fails the test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fake_worker import FakeWorker, NextToken, by_position

from loomllm.core.request import Request, RequestStatus
from loomllm.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig
from loomllm.protocols.messages import SchedulerOutput, StepResult, TopLogprobs
from loomllm.protocols.sampling import SamplingParams

EOS = 0


def make_config(**overrides: object) -> SchedulerConfig:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=64
    )
    return SchedulerConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def make_request(
    request_id: str, prompt: list[int], max_model_len: int = 128, **params: object
) -> Request:
    sampling = SamplingParams(**{"max_tokens": 8, **params})  # type: ignore[arg-type]
    return Request(request_id, prompt, sampling, frozenset({EOS}), max_model_len, 0.0)


def reference(
    prompt: list[int],
    params: SamplingParams,
    max_model_len: int,
    next_token: NextToken = by_position,
) -> tuple[list[int], str, int | None]:
    """What the request must produce, computed without any scheduler."""
    room = max_model_len - len(prompt)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    output: list[int] = []
    while True:
        token = next_token(prompt, output)
        output.append(token)
        if len(output) >= params.min_tokens:
            if token == EOS and not params.ignore_eos:
                return output, "stop", None
            if token in params.stop_token_ids:
                return output, "stop", token
        if len(output) >= max_tokens or len(prompt) + len(output) >= max_model_len:
            return output, "length", None


class Driver:
    """Scheduler + FakeWorker stepped like EngineCore, collecting each request's stream.

    With `async_scheduling` each step's result is applied only after the next step is
    scheduled (and run), as EngineCore does with two steps in flight.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        next_token: NextToken = by_position,
        async_scheduling: bool = False,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.worker = FakeWorker(config.block_size, config.num_blocks, next_token)
        self.streams: dict[str, list[EngineCoreOutput]] = {}
        self.outputs: list[SchedulerOutput] = []
        self.async_scheduling = async_scheduling
        self.held: tuple[SchedulerOutput, StepResult] | None = None  # sent ahead, not applied

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        self.streams[request.request_id] = []
        return request

    def step(self, during_step: Callable[[], None] | None = None) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.outputs.append(so)
        assert len(so.num_scheduled_tokens) <= self.config.max_num_seqs
        assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert self.scheduler.num_running <= self.config.max_num_seqs
        if during_step is not None:
            during_step()
        done: tuple[SchedulerOutput, StepResult] | None = (so, self.worker.execute(so))
        if self.async_scheduling:
            sent = so.num_scheduled_tokens or so.finished_req_ids  # EngineCore sends no other
            done, self.held = self.held, (done if sent else None)
        if done is not None:
            for out in self.scheduler.update_from_output(*done):
                self.streams[out.request_id].append(out)
        return so

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and self.held is None:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.streams[request_id] for t in out.new_token_ids]

    def finish(self, request_id: str) -> tuple[str | None, int | str | None]:
        last = self.streams[request_id][-1]
        return last.finish_reason, last.stop_reason


# -- config and intake -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"block_size": 2.0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"max_model_len": 257}, "max_model_len"),  # more than 64 blocks of 4 hold
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 99}, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_config_is_validated(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_config(**overrides)


def test_add_request_rejects_what_could_never_run() -> None:
    scheduler = Scheduler(make_config(max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("a", list(range(1, 18)), max_model_len=16))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("b", [], max_model_len=16))
    scheduler.add_request(make_request("c", [1, 2], max_model_len=16))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("c", [1, 2], max_model_len=16))
    assert scheduler.num_waiting == 1


# -- batching --------------------------------------------------------------------------


def test_num_computed_tokens_advances_in_schedule_and_messages_carry_the_old_value() -> None:
    driver = Driver(make_config())
    request = driver.add(make_request("a", list(range(1, 11))))
    so = driver.scheduler.schedule()
    assert request.num_computed_tokens == 10 and request.status is RequestStatus.RUNNING
    (new,) = so.new_requests
    assert new.num_computed_tokens == 0 and new.block_ids == [0, 1, 2]
    assert new.eos_token_ids == [EOS] and new.output_token_ids == []
    driver.scheduler.update_from_output(so, driver.worker.execute(so))
    assert request.num_computed_tokens == 10 and request.num_tokens == 11  # not counted twice
    so = driver.step()
    assert so.cached.num_computed_tokens[0] == 10
    assert so.num_scheduled_tokens == {"a": 1} and request.num_computed_tokens == 11


def test_async_scheduling_schedules_a_decode_before_its_input_token_is_back() -> None:
    driver = Driver(make_config(), async_scheduling=True)
    request = driver.add(make_request("a", [1, 2, 3], max_tokens=3, ignore_eos=True))
    driver.step()  # the prompt: samples token 1, its result held
    assert (request.num_output_placeholders, request.num_tokens) == (1, 3)
    so = driver.step()  # computes token 1 before knowing it; then token 1 comes back
    assert so.num_scheduled_tokens == {"a": 1} and so.cached.num_computed_tokens == [3]
    assert (request.num_output_tokens, request.num_output_placeholders) == (1, 1)
    assert request.num_computed_tokens == 4
    assert driver.step().num_scheduled_tokens == {"a": 1}  # samples token 3
    # Token 3 is the last (max_tokens) and in flight: no step computes past it.
    assert driver.step().num_scheduled_tokens == {}
    assert request.num_output_placeholders == 0 and request.num_computed_tokens == 5
    expected, reason, _ = reference([1, 2, 3], request.sampling_params, 128)
    assert (driver.tokens("a"), driver.finish("a")) == (expected, (reason, None))
    assert reason == "length"


def test_limits_hold_with_many_requests() -> None:
    driver = Driver(make_config(max_num_seqs=3, max_num_batched_tokens=20))
    for i in range(10):
        driver.add(make_request(f"r{i}", [i + 1] * (5 + 3 * i), max_tokens=6))
    driver.run()  # Driver.step asserts both limits every step
    assert max(len(so.num_scheduled_tokens) for so in driver.outputs) == 3
    assert max(so.total_num_scheduled_tokens for so in driver.outputs) == 20
    for i in range(10):
        expected = reference([i + 1] * (5 + 3 * i), SamplingParams(max_tokens=6), 128)
        assert driver.tokens(f"r{i}") == expected[0]


def test_chunked_prefill_splits_a_long_prompt() -> None:
    driver = Driver(make_config(max_num_batched_tokens=16))
    driver.add(make_request("long", list(range(1, 51)), max_tokens=3, ignore_eos=True))
    scheduled = [driver.step().num_scheduled_tokens["long"] for _ in range(4)]
    assert scheduled == [16, 16, 16, 2]
    assert [len(s) for s in driver.streams.values()] == [1]  # sampled only after the last chunk
    driver.run()
    assert len(driver.tokens("long")) == 3


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    driver = Driver(make_config(max_num_batched_tokens=16))
    driver.add(make_request("short", [1, 2, 3], max_tokens=20, ignore_eos=True))
    driver.step()
    driver.add(make_request("long", list(range(1, 41)), max_tokens=2))
    so = driver.step()
    assert so.num_scheduled_tokens == {"short": 1, "long": 15}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    config = make_config(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    driver = Driver(config)
    driver.add(make_request("short", [1, 2], max_model_len=32, max_tokens=3, ignore_eos=True))
    driver.step()
    driver.add(make_request("long", list(range(1, 33)), max_model_len=32))
    assert driver.step().num_scheduled_tokens == {"short": 1}  # 31 left: too few
    driver.run()
    assert {"long": 32} in [so.num_scheduled_tokens for so in driver.outputs]
    assert driver.finish("long") == ("length", None)  # a full-length prompt gets one token


def test_prefix_cache_hit_reduces_scheduled_tokens() -> None:
    driver = Driver(make_config(block_size=8))
    shared = list(range(1, 34))
    driver.add(make_request("a", shared + [40, 41, 42, 43, 44, 45, 46]))
    driver.run()
    b = driver.add(make_request("b", shared + [50, 51]))
    so = driver.step()
    assert so.num_scheduled_tokens == {"b": 3} and so.new_requests[0].num_computed_tokens == 32
    assert b.num_cached_tokens == 32
    driver.run()  # the fake KV check proves the hit blocks hold b's prefix
    assert driver.tokens("b") == reference(shared + [50, 51], b.sampling_params, 128)[0]
    assert driver.scheduler.kv_cache_manager.prefix_cache_hit_rate == pytest.approx(32 / 75)


def test_identical_prompts_in_one_step_share_blocks() -> None:
    driver = Driver(make_config())
    prompt = list(range(1, 19))
    driver.add(make_request("a", prompt))
    driver.add(make_request("b", prompt))
    so = driver.step()
    assert so.num_scheduled_tokens == {"a": 18, "b": 2}
    assert so.new_requests[1].block_ids[:4] == so.new_requests[0].block_ids[:4]
    driver.run()
    assert driver.tokens("a") == driver.tokens("b")


def test_a_steps_new_requests_carry_a_bounded_number_of_ids(monkeypatch) -> None:
    """Requests sharing a long cached prefix cost a step almost nothing to compute, but each
    carries its whole prompt to the workers: admissions stop at MAX_NEW_REQUEST_TOKENS
    ids a step (one request always goes), so the frame never outgrows its limit."""
    from loomllm.core import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_NEW_REQUEST_TOKENS", 50)
    driver = Driver(make_config())
    prompt = list(range(1, 19))
    requests = [driver.add(make_request(f"r{i}", prompt)) for i in range(5)]
    driver.add(make_request("big", list(range(60, 120))))  # alone over the bound: still goes
    carried = []
    while driver.scheduler.has_unfinished_requests():
        so = driver.step()
        carried.append([len(new.prompt_token_ids) for new in so.new_requests])
    assert carried[:4] == [[18, 18], [18, 18], [18], [60]], carried
    for request in requests:
        assert (
            driver.tokens(request.request_id) == reference(prompt, request.sampling_params, 128)[0]
        )


def test_allowed_ids_and_logit_bias_count_toward_a_steps_ids(monkeypatch) -> None:
    """A request's allowed ids and logit bias cross to the workers with it: a batch of them
    (a full vocabulary's each) once outgrew the frame and ended the engine."""
    from loomllm.core import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "MAX_NEW_REQUEST_TOKENS", 100)
    driver = Driver(make_config())
    prompt = [1, 2, 3, 4]
    driver.add(make_request("allowed", prompt, allowed_token_ids=list(range(40)) * 3))
    driver.add(make_request("bias", prompt, logit_bias={t: 1.0 for t in range(20)}))
    driver.add(make_request("plain", prompt))
    assert [r.num_wire_ids for r in driver.scheduler.waiting] == [44, 64, 4]  # 40 ids, once
    carried = [[new.req_id for new in driver.step().new_requests] for _ in range(2)]
    assert carried == [["allowed"], ["bias", "plain"]], carried


def test_the_most_ids_a_step_carries_fit_a_frame() -> None:
    """MAX_NEW_REQUEST_TOKENS ids, each of the widest msgpack int a vocabulary id takes."""
    from loomllm.core.scheduler import MAX_NEW_REQUEST_TOKENS
    from loomllm.protocols.codec import encode
    from loomllm.protocols.framing import DEFAULT_MAX_FRAME_SIZE
    from loomllm.protocols.messages import CachedRequests, ExecuteStep, NewRequestData

    each = MAX_NEW_REQUEST_TOKENS // 256
    new = [
        NewRequestData(f"r{i}", [2**32 - 1] * each, [], SamplingParams(), [2], [], 0)
        for i in range(256)
    ]
    so = SchedulerOutput(0, new, CachedRequests([], [], []), {f"r{i}": 1 for i in range(256)}, [])
    assert len(encode(ExecuteStep(1, so))) < DEFAULT_MAX_FRAME_SIZE / 2


# -- preemption ------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_recomputes_and_gives_the_same_tokens(enable_prefix_caching: bool) -> None:
    config = make_config(
        num_blocks=8, block_size=4, max_model_len=32, enable_prefix_caching=enable_prefix_caching
    )
    driver = Driver(config)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(3)}
    for req_id, prompt in prompts.items():
        driver.add(make_request(req_id, prompt, max_model_len=32, max_tokens=14, ignore_eos=True))
    driver.run()
    assert driver.scheduler.num_preemptions > 0
    resumed = [n for so in driver.outputs for n in so.new_requests if n.output_token_ids]
    assert resumed
    for new in resumed:
        so = next(so for so in driver.outputs if new in so.new_requests)
        assert new.req_id not in so.finished_req_ids  # dropped in an earlier step
        assert any(new.req_id in o.finished_req_ids for o in driver.outputs[: so.step_id])
    for req_id, prompt in prompts.items():
        params = SamplingParams(max_tokens=14, ignore_eos=True)
        assert driver.tokens(req_id) == reference(prompt, params, 32)[0]
        assert driver.finish(req_id) == ("length", None)
    kv = driver.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_preempted_requests_go_back_first_in_line() -> None:
    driver = Driver(make_config(num_blocks=4, block_size=2, max_model_len=8))
    for i in range(3):
        driver.add(make_request(f"r{i}", [i + 1] * 3, max_model_len=8, ignore_eos=True))
    driver.step()
    assert [r.request_id for r in driver.scheduler.running] == ["r0", "r1"]
    driver.step()  # position 3 still fits the second block
    driver.step()  # position 4 needs a third block for each: r1 is preempted
    assert [r.request_id for r in driver.scheduler.waiting] == ["r1", "r2"]
    assert next(iter(driver.scheduler.waiting)).status is RequestStatus.PREEMPTED
    assert driver.outputs[-1].finished_req_ids == ["r1"]
    assert driver.outputs[-1].num_scheduled_tokens == {"r0": 1}  # no admission this step


def test_priority_orders_admission_then_arrival() -> None:
    """Lower priority first; equal ones by arrival, then intake (a request's n children)."""
    driver = Driver(make_config(max_num_seqs=1, scheduling_policy="priority"))
    for name, priority, arrival in [
        ("late-low", 5, 0.0),
        ("urgent", -1, 3.0),
        ("a", 0, 1.0),
        ("b", 0, 1.0),
        ("early", 0, 0.5),
    ]:
        request = Request(
            name,
            [1, 2, 3],
            SamplingParams(max_tokens=2, ignore_eos=True),
            frozenset({EOS}),
            128,
            arrival,
            priority,
        )
        driver.add(request)
    order = [r.request_id for r in driver.scheduler.waiting]
    assert order == ["urgent", "early", "a", "b", "late-low"]
    queue = driver.scheduler.waiting  # a preempted request takes its own place again
    popped = [queue.pop() for _ in range(3)]  # urgent, early, a
    queue.push_preempted(popped[-1])  # "a" ties with "b": it came first, it goes first
    assert [r.request_id for r in queue] == ["a", "b", "late-low"]
    for request in popped[:2]:
        queue.push_preempted(request)
    admitted = []
    while driver.scheduler.has_unfinished_requests():
        so = driver.step()
        admitted += [new.req_id for new in so.new_requests]
    assert admitted == order


def test_priority_preempts_the_lowest_priority_even_one_scheduled_earlier_in_the_step() -> None:
    """Out of blocks, the victim is the lowest-priority running request (FCFS: the newest),
    though the step has scheduled it already: its tokens and budget are taken back."""
    config = make_config(num_blocks=5, block_size=2, max_model_len=8, scheduling_policy="priority")
    driver = Driver(config)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    low = Request("low", [3, 4, 5], params, frozenset({EOS}), 8, 0.0, 1)
    high = Request("high", [6, 7, 8, 9], params, frozenset({EOS}), 8, 1.0, 0)
    driver.add(low)
    driver.step()  # "low" alone: it runs first from here on
    driver.add(high)
    driver.step()  # both hold two blocks now; one is free
    assert [r.request_id for r in driver.scheduler.running] == ["low", "high"]
    so = driver.step()  # each needs a third: "low" takes the last, then gives it up
    assert so.num_scheduled_tokens == {"high": 1} and so.cached.req_ids == ["high"]
    assert len(so.cached.new_block_ids) == len(so.cached.num_computed_tokens) == 1
    assert [r.request_id for r in driver.scheduler.waiting] == ["low"]
    assert so.finished_req_ids == ["low"]
    driver.run()
    assert driver.tokens("low") == reference([3, 4, 5], params, 8)[0]
    assert driver.tokens("high") == reference([6, 7, 8, 9], params, 8)[0]


def test_an_undone_victim_leaves_no_cache_entry_for_kv_never_written() -> None:
    """Its allocation this step hashed the block its decode was to fill; undone, that block
    must not be found by a prompt that starts with its tokens (found by fuzzing)."""
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    config = make_config(
        block_size=3,
        num_blocks=11,
        max_model_len=33,
        max_num_batched_tokens=13,
        scheduling_policy="priority",
    )
    driver = Driver(config)

    def request(name: str, prompt: list[int], priority: int, arrival: float) -> Request:
        return Request(name, prompt, params, frozenset({EOS}), 33, arrival, priority)

    driver.add(request("X", [10, 13, 8, 1, 3, 7], 0, 0.0))
    driver.add(request("V", [19, 3, 19, 3], 2, 0.0))
    for _ in range(4):
        driver.step()  # V has computed positions 0..7
    driver.add(request("R", [(i * 7) % 19 + 1 for i in range(33)], 1, 4.0))
    driver.step()  # R admitted mid-prefill: the cache is full
    so = driver.step()  # V's decode hashes its block 2, is undone, and R preempts itself
    assert so.num_scheduled_tokens == {"X": 1} and so.finished_req_ids == ["V", "R"]
    v_tokens = [19, 3, 19, 3, *driver.tokens("V")]
    assert len(v_tokens) == 9
    driver.add(request("W", [*v_tokens, 9], -2, 5.0))
    hit = driver.scheduler.kv_cache_manager.get_computed_blocks(driver.scheduler.requests["W"])
    assert hit[1] == 6  # blocks 0 and 1, written; not block 2 (positions 6..8)
    driver.run()  # the FakeWorker checks every context slot W reads
    for name, prompt in [("X", [10, 13, 8, 1, 3, 7]), ("V", [19, 3, 19, 3])]:
        assert driver.tokens(name) == reference(prompt, params, 33)[0]


def test_no_admission_in_a_step_that_preempted() -> None:
    config = make_config(num_blocks=4, block_size=2, max_model_len=8, max_num_batched_tokens=3)
    driver = Driver(config)
    driver.add(make_request("r0", [1, 2, 3, 4, 5], max_model_len=8, ignore_eos=True))
    driver.add(make_request("r1", [6, 7, 8], max_model_len=8, ignore_eos=True))
    driver.step()
    assert driver.step().num_scheduled_tokens == {"r0": 2, "r1": 1}  # all 4 blocks held
    so = driver.step()  # r1's next chunk needs a block: r1 preempts itself
    # Its freed block would fit the 2 tokens of budget left, yet it waits a step.
    assert so.num_scheduled_tokens == {"r0": 1} and so.finished_req_ids == ["r1"]


# -- stop conditions -------------------------------------------------------------------


def scripted(script: list[int]) -> NextToken:
    return lambda prompt, output: script[len(output)]


@pytest.mark.parametrize(
    ("params", "script", "expected"),
    [
        ({}, [5, 6, EOS, 7], ([5, 6, EOS], "stop", None)),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 7, 8], ([5, EOS, 7], "length", None)),
        ({"min_tokens": 2}, [EOS, 5, EOS, 7], ([EOS, 5, EOS], "stop", None)),
        ({"stop_token_ids": (6,)}, [5, 6, 7], ([5, 6], "stop", 6)),
        ({"stop_token_ids": (6,), "min_tokens": 2}, [6, 5, 6, 7], ([6, 5, 6], "stop", 6)),
        ({"max_tokens": 2}, [5, 6, 7], ([5, 6], "length", None)),
        ({"max_tokens": 2}, [5, EOS, 7], ([5, EOS], "stop", None)),  # stop wins a tie
        ({"max_tokens": None}, [5, 6, 7, 8, 9, 10, 11], ([5, 6, 7, 8, 9, 10], "length", None)),
    ],
)
def test_stop_conditions(
    params: dict[str, object], script: list[int], expected: tuple[list[int], str, int | None]
) -> None:
    driver = Driver(make_config(max_model_len=16), scripted(script))
    # 10 prompt tokens: max_model_len=16 leaves room for 6.
    request = driver.add(make_request("a", list(range(1, 11)), max_model_len=16, **params))
    driver.run()
    assert (driver.tokens("a"), *driver.finish("a")) == expected
    assert request.output_token_ids == expected[0] and request.finish_reason == expected[1]
    assert all(out.finish_reason is None for out in driver.streams["a"][:-1])
    assert driver.scheduler.kv_cache_manager.num_free_blocks == 64
    assert "a" in driver.scheduler.schedule().finished_req_ids


def test_outputs_carry_logprobs() -> None:
    driver = Driver(make_config(), scripted([3, 4, EOS]))
    driver.add(make_request("a", [1, 2]))
    driver.run()
    outs = driver.streams["a"]
    assert [o.new_logprobs for o in outs] == [[-0.5]] * 3
    assert [o.new_top_logprobs for o in outs] == [[TopLogprobs([3], [-0.5])], [None], [None]]


# -- aborts ----------------------------------------------------------------------------


def test_abort_mid_flight_frees_blocks_and_ignores_the_result() -> None:
    driver = Driver(make_config())
    driver.add(make_request("a", list(range(1, 10)), max_tokens=50, ignore_eos=True))
    driver.add(make_request("b", list(range(1, 6)), max_tokens=50, ignore_eos=True))
    driver.step()
    scheduler = driver.scheduler
    request_a = scheduler.requests["a"]

    def abort() -> None:
        scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
        assert scheduler.kv_cache_manager.num_free_blocks == 64 - 2  # only b's blocks

    driver.step(during_step=abort)
    assert [o.request_id for o in driver.streams.values() for o in o][-1] == "b"
    assert len(driver.tokens("a")) == 1 and request_a.finish_reason == "abort"
    so = driver.step()
    assert so.finished_req_ids == ["a"] and "a" not in driver.worker.states
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # already gone: ignored
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_STOPPED)  # a stop string
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_abort_while_waiting() -> None:
    driver = Driver(make_config(max_num_seqs=1))
    driver.add(make_request("a", [1, 2, 3], max_tokens=4, ignore_eos=True))
    waiting = driver.add(make_request("b", [1, 2, 3]))
    driver.step()
    driver.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert driver.scheduler.num_waiting == 0 and waiting.finish_reason == "abort"
    driver.run()
    assert driver.finish("a") == ("length", None)
    with pytest.raises(ValueError, match="FINISHED"):
        driver.scheduler.finish_requests(["a"], RequestStatus.RUNNING)


# -- property: random traffic over a small cache ---------------------------------------

BASE_PROMPTS = [[(b * 17 + i * 5) % 19 + 1 for i in range(64)] for b in range(3)]


@st.composite
def scheduler_configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 10))
    max_model_len = min(draw(st.integers(4, 64)), num_blocks * block_size)
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 40))
    return SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


request_specs = st.fixed_dictionaries(
    {
        "arrival": st.integers(0, 20),
        "base": st.integers(0, 2),
        "shared": st.integers(0, 24),  # tokens taken from a base prompt: shared prefixes
        "own": st.integers(1, 10),
        "max_tokens": st.one_of(st.none(), st.integers(1, 32)),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop_token": st.one_of(st.none(), st.integers(1, 19)),
        "abort_at": st.one_of(st.none(), st.integers(0, 40)),
        "abort_mid_flight": st.booleans(),
        "priority": st.integers(-2, 2),  # used under the "priority" policy
    }
)


def check_blocks(scheduler: Scheduler) -> None:
    """No block owned twice unless it is a shared prefix-cache block with the right ref count."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    assert {r.request_id for r in scheduler.running} == set(kv.req_to_blocks)
    for req_id, blocks in kv.req_to_blocks.items():
        request = scheduler.requests[req_id]
        assert request.status is RequestStatus.RUNNING
        assert len(blocks) == -(-request.num_computed_tokens // kv.block_size)
        assert len(set(blocks)) == len(blocks)
        holders.update(blocks)
    for block_id in range(kv.num_total_blocks):
        assert pool.ref_cnt[block_id] == holders[block_id]
        assert (block_id in pool.free_block_queue) == (holders[block_id] == 0)
        if holders[block_id] > 1:
            assert pool.block_hashes[block_id] is not None
    for block_hash, block_id in pool.cached_block_hash_to_block.items():
        assert pool.block_hashes[block_id] == block_hash
    assert kv.num_free_blocks + len(+holders) == kv.num_total_blocks
    assert all(
        r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting
    )


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(config=scheduler_configs(), specs=st.lists(request_specs, min_size=1, max_size=10))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_traffic_keeps_blocks_consistent_and_finishes_everything(
    async_scheduling: bool, config: SchedulerConfig, specs: list[dict]
) -> None:
    driver = Driver(config, async_scheduling=async_scheduling)
    scheduler = driver.scheduler
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    last_event = max(max(s["arrival"], s["abort_at"] or 0) for s in specs)
    step = 0
    while step <= last_event or scheduler.has_unfinished_requests() or driver.held:
        for k, spec in enumerate(specs):
            if spec["arrival"] == step:
                own = [(k * 7 + j) % 19 + 1 for j in range(spec["own"])]
                prompt = BASE_PROMPTS[spec["base"]][: spec["shared"]] + own
                prompt = prompt[: config.max_model_len]
                max_tokens = spec["max_tokens"]
                params = SamplingParams(
                    max_tokens=max_tokens,
                    ignore_eos=spec["ignore_eos"],
                    min_tokens=min(spec["min_tokens"], max_tokens or 3),
                    stop_token_ids=() if spec["stop_token"] is None else (spec["stop_token"],),
                )
                priority = spec["priority"] if config.scheduling_policy == "priority" else 0
                request = Request(
                    f"r{k}",
                    prompt,
                    params,
                    frozenset({EOS}),
                    config.max_model_len,
                    float(step),
                    priority,
                )
                requests[request.request_id] = driver.add(request)
        to_abort: dict[bool, list[str]] = {True: [], False: []}
        for k, spec in enumerate(specs):
            if spec["abort_at"] == step and f"r{k}" in scheduler.requests:
                to_abort[spec["abort_mid_flight"]].append(f"r{k}")
                aborted.add(f"r{k}")
        scheduler.finish_requests(to_abort[False], RequestStatus.FINISHED_ABORTED)
        had_work = scheduler.has_unfinished_requests()
        in_flight = driver.held is not None  # its result is applied this step
        mid_flight = to_abort[True]
        so = driver.step(
            lambda ids=mid_flight: scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        )
        assert so.total_num_scheduled_tokens > 0 or not had_work or in_flight  # never stuck
        check_blocks(scheduler)
        step += 1
        assert step < 2000, "no progress"

    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not kv.req_to_blocks
    assert not scheduler.requests and not kv._req_to_block_hashes
    # Nor a step's samplers: steps that scheduled nothing were never sent, never applied.
    assert not scheduler._samplers
    driver.worker.execute(scheduler.schedule())  # the last finished ids reach the worker
    assert not driver.worker.states
    for req_id, request in requests.items():
        tokens = driver.tokens(req_id)
        assert request.is_finished and request.output_token_ids == tokens
        expected, reason, stop_reason = reference(
            request.prompt_token_ids, request.sampling_params, config.max_model_len
        )
        if req_id in aborted:
            assert request.finish_reason == "abort" and tokens == expected[: len(tokens)]
        else:
            assert (tokens, *driver.finish(req_id)) == (expected, reason, stop_reason)
