"""Async scheduling: step N+1 goes out before step N's tokens are back, with the same outputs.

The model runner launched one step ahead (its decodes read the previous step's tokens
from the device) samples what it samples step by step; engines with async scheduling on,
on with the worker's launch-ahead forced (the CUDA path, here on the CPU), and off give
identical outputs for greedy, seeded, penalized, stopped, n=2 and logprob requests; a
step that raises fails only its requests, and aborts mid-flight free everything.
(Greedy parity with HF under async scheduling: tests/e2e/test_generation_parity.py.)
"""

from __future__ import annotations

import anyio
import pytest
import torch
from support.runner_driver import drive
from support.worker_hooks import fail_next_launch, fail_next_result, launch_ahead

from loomllm import Engine
from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.errors import EngineStepError
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.models.loader import load_model
from loomllm.workers.runner.model_runner import ModelRunner

EOS = 2
RUNNER_REQUESTS = {
    "greedy": ([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    "seeded": ([10, 11, 12], SamplingParams(temperature=1.0, seed=7, max_tokens=12)),
    "penalized": (
        [13, 14, 15, 16],
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=12
        ),
    ),
    # Nearly every token stops it, but only from the 5th on (4 come first): min_tokens
    # must count the token still on the device, or the ban would last a step longer.
    "min_tokens": (
        [17, 18],
        SamplingParams(
            temperature=0.0, min_tokens=4, max_tokens=10, stop_token_ids=list(range(3, 250))
        ),
    ),
    "logprobs": (
        [19, 20, 21],
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=3, prompt_logprobs=2),
    ),
    "chunked": (list(range(30, 70)), SamplingParams(temperature=0.0, max_tokens=6)),
    # Most low ids banned, and any id from 120 on banned right after itself: the bans read
    # the output ids, the one still on the device included.
    "bad_words": (
        [22, 23, 24],
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            ignore_eos=True,
            bad_words_token_ids=[[t] for t in range(3, 120)] + [[t, t] for t in range(120, 250)],
        ),
    ),
}


def drive_runner(
    runner: ModelRunner, ahead: bool, requests: dict[str, tuple] = RUNNER_REQUESTS
) -> dict[str, list[tuple]]:
    """`requests` (RUNNER_REQUESTS) through a real Scheduler: each one's (tokens, logprobs,
    top logprobs, finish reason) per step."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=24,
            max_model_len=64,
            block_size=16,
            num_blocks=runner.num_blocks,
        )
    )
    for req_id, (prompt, params) in requests.items():
        scheduler.add_request(Request(req_id, prompt, params, frozenset({EOS}), 64, 0.0))
    return {
        req_id: [
            (o.new_token_ids, o.new_logprobs, o.new_top_logprobs, o.finish_reason) for o in outs
        ]
        for req_id, outs in drive(scheduler, runner, ahead).items()
    }


def tokens_and_ends(outputs: dict[str, list[tuple]]) -> dict[str, list]:
    return {req_id: [(o[0], o[3]) for o in outs] for req_id, outs in outputs.items()}


def make_runner(model_dir: str, num_blocks: int = 24) -> ModelRunner:
    loaded = load_model(model_dir, dtype="float32")
    return ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        num_blocks=num_blocks,
    )


def test_bad_words_of_several_tokens_read_the_token_still_on_the_device(tiny_model):
    """Alone in its batch (nothing else makes the runner wait for the step before), a
    request whose bans depend on its last token: launched ahead, it must wait for it."""
    requests = {"bad_words": RUNNER_REQUESTS["bad_words"]}
    step_by_step = drive_runner(make_runner(tiny_model), ahead=False, requests=requests)
    ahead = drive_runner(make_runner(tiny_model), ahead=True, requests=requests)
    assert tokens_and_ends(ahead) == tokens_and_ends(step_by_step)
    tokens = [t for o in ahead["bad_words"] for t in o[0]]
    assert all(a != b for a, b in zip(tokens, tokens[1:], strict=False))


def test_runner_launched_ahead_samples_what_it_samples_step_by_step(tiny_model):
    step_by_step = drive_runner(make_runner(tiny_model), ahead=False)
    ahead = drive_runner(make_runner(tiny_model), ahead=True)
    assert tokens_and_ends(ahead) == tokens_and_ends(step_by_step)
    # Batches differ (a finished request may be computed once more): the last float bits too.
    for req_id, outs in ahead.items():
        for (_, lps, top, _), (_, ref_lps, ref_top, _) in zip(
            outs, step_by_step[req_id], strict=True
        ):
            assert lps == pytest.approx(ref_lps, abs=1e-5)
            assert [t and t.token_ids for t in top] == [t and t.token_ids for t in ref_top]
    lengths = {req_id: sum(len(o[0]) for o in outs) for req_id, outs in ahead.items()}
    assert lengths == {
        "greedy": 12,
        "seeded": lengths["seeded"],
        "penalized": 12,
        "min_tokens": 5,
        "logprobs": 9,
        "chunked": 6,
        "bad_words": 10,
    }
    banned_tokens = [t for o in ahead["bad_words"] for t in o[0]]
    assert all(t >= 120 for t in banned_tokens)
    assert all(a != b for a, b in zip(banned_tokens, banned_tokens[1:], strict=False))
    assert all(outs[-1][3] is not None for outs in ahead.values())


def test_runner_launched_ahead_through_preemptions(tiny_model):
    """A KV cache of 6 blocks for 6 requests of up to 3: requests are preempted with a step
    of theirs in flight, recomputed, and still get the tokens of a cache roomy enough for
    none to be: greedy ones, and seeded sampled ones (whose generator restarted from its
    seed at each recompute, repeating the first tokens, until each draw had its own)."""
    runs, preemptions = [], []
    for ahead, blocks in ((False, 64), (False, 6), (True, 6)):
        scheduler = Scheduler(SchedulerConfig(8, 32, 64, 16, blocks))
        for i in range(6):
            params = SamplingParams(
                temperature=0.0 if i % 2 else 1.0,
                seed=None if i % 2 else i,
                max_tokens=16 + 4 * i,
                ignore_eos=True,
            )
            prompt = [3 + i + j for j in range(6 + 3 * i)]
            scheduler.add_request(Request(f"r{i}", prompt, params, frozenset({EOS}), 64, 0.0))
        outputs = drive(scheduler, make_runner(tiny_model, blocks), ahead)
        runs.append({r: [t for o in outs for t in o.new_token_ids] for r, outs in outputs.items()})
        preemptions.append(scheduler.num_preemptions)
    assert runs[2] == runs[1] == runs[0], preemptions
    assert preemptions[0] == 0 and min(preemptions[1:]) > 0, preemptions
    assert [len(tokens) for tokens in runs[2].values()] == [16 + 4 * i for i in range(6)]


def test_idle_probe_counts_each_launched_step(tiny_model):
    runner = make_runner(tiny_model)
    launched = []
    launch = runner.launch
    runner.launch = lambda so, call_id: (launched.append(call_id), launch(so, call_id))[1]
    runner.start_idle_probe()
    drive_runner(runner, ahead=True)
    device = runner.stop_idle_probe()
    assert device.steps == len(launched) > 10 and runner.idle_probe is None
    assert device.busy_s > 0 and device.idle_s > 0 and 0 < device.idle_fraction < 1
    # No graph replays on the CPU: every step counts as eager.
    assert device.eager_steps == device.steps and device.eager_busy_s == device.busy_s


def test_a_step_skips_hf_mask_preparation(tiny_model, monkeypatch):
    """HF's mask preparation checks position_ids for packed sequences with a `.all()`
    that waits for the device mid-forward: the launch-ahead would stall on it."""
    import transformers.masking_utils

    def host_sync(*args, **kwargs):
        raise AssertionError("mask preparation ran")

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", host_sync)
    assert drive_runner(make_runner(tiny_model), ahead=True)["greedy"]


def test_runner_refuses_a_step_whose_input_token_it_never_sampled(tiny_model):
    runner = make_runner(tiny_model)
    scheduler = Scheduler(SchedulerConfig(8, 64, 64, 16, runner.num_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    scheduler.add_request(Request("a", [5, 6, 7], params, frozenset({EOS}), 64, 0.0))
    runner.launch(scheduler.schedule(), 0)
    runner.launch(scheduler.schedule(), 1)  # reads step 0's token from the device
    # Step 2 would read step 0's token from the host, but nobody read it back.
    with pytest.raises(RuntimeError, match="request 'a' computes position 4, but holds 3"):
        runner.launch(scheduler.schedule(), 2)


# -- through the engine ----------------------------------------------------------------

PROMPTS = ["w5 w7 w9", "w11 w12", "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14"]
ENGINE_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=3, max_tokens=16, n=2, logprobs=2),
    SamplingParams(
        temperature=0.0,
        max_tokens=24,
        frequency_penalty=0.7,
        min_tokens=3,
        stop_token_ids=[40, 41, 42, 43],
    ),
    SamplingParams(temperature=0.0, max_tokens=30, stop=["w1"], ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1, ignore_eos=True),
]


async def all_outputs(engine: Engine) -> list:
    results: dict[tuple[int, int], object] = {}

    async def one(i: int, j: int) -> None:
        async for out in engine.generate(PROMPTS[i], ENGINE_PARAMS[j]):
            results[i, j] = out

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            for j in range(len(ENGINE_PARAMS)):
                tg.start_soon(one, i, j)
    return [
        (
            key,
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs],
            logprob_values(out),
        )
        for key, out in sorted(results.items())
    ]


def logprob_values(out) -> list[tuple[int, float]]:
    """Every (token id, logprob) the output carries, prompt logprobs first."""
    rows = list(out.prompt_logprobs or []) + [r for c in out.outputs for r in c.logprobs or []]
    return [(token, lp.logprob) for row in rows if row for token, lp in row.items()]


def assert_same_outputs(outputs: list, reference: list) -> None:
    """Tokens, text and finish reasons exactly; logprobs to float noise (batches differ:
    a finished request may be computed once more, which moves the last bits)."""
    assert [o[:2] for o in outputs] == [r[:2] for r in reference]
    for (_, _, lps), (_, _, ref) in zip(outputs, reference, strict=True):
        assert [t for t, _ in lps] == [t for t, _ in ref]
        assert [lp for _, lp in lps] == pytest.approx([lp for _, lp in ref], abs=1e-5)


@pytest.mark.anyio
async def test_engine_outputs_are_identical_with_async_scheduling_on_and_off(
    tiny_model, shared_manager, anyio_backend
):
    runs = {}
    settings = {"off": False, "on": True, "on, launch ahead": True, "default": None}
    for mode, setting in settings.items():
        async with Engine(
            tiny_model,
            manager_socket=shared_manager.socket,
            dtype="float32",
            async_scheduling=setting,
            seed=11,
        ) as engine:
            if mode == "on, launch ahead":
                await engine.collective_rpc(launch_ahead)
            core = engine._replicas[0].core
            # The default on a CPU worker: steps of more requests run ahead only when
            # their outputs are whole (test_step_loop checks which).
            assert (core.async_scheduling, core.ahead_max_rows) == {
                False: (False, None),
                True: (True, None),
                None: (True, 1),
            }[setting]
            runs[mode] = await all_outputs(engine)
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
    assert_same_outputs(runs["on"], runs["off"])
    assert_same_outputs(runs["on, launch ahead"], runs["off"])
    assert_same_outputs(runs["default"], runs["off"])
    finish_reasons = {c[2] for _, outs, _ in runs["off"] for c in outs}
    assert finish_reasons == {"stop", "length"}
    assert sum(len(lps) for _, _, lps in runs["off"]) > 100


LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def async_engine(model: str, manager) -> Engine:
    return Engine(model, manager_socket=manager.socket, dtype="float32", async_scheduling=True)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fault", "where"),
    [
        (fail_next_launch, "in the forward pass"),
        (fail_next_result, "reading the step's tokens"),
    ],
    ids=["launch", "result"],
)
async def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(
    tiny_model, shared_manager, anyio_backend, fault, where
):
    async with async_engine(tiny_model, shared_manager) as engine:
        expected = [o async for o in engine.generate("w5 w6", SHORT)][-1].outputs[0].token_ids
        errors: list[str] = []

        async def doomed(prompt: str, started: anyio.Event) -> None:
            try:
                async for _ in engine.generate(prompt, LONG):
                    started.set()
            except EngineStepError as exc:
                errors.append(str(exc))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for prompt in ("w7 w8", "w9"):
                    started = anyio.Event()
                    tg.start_soon(doomed, prompt, started)
                    await started.wait()
                await engine.collective_rpc(launch_ahead)
                await engine.collective_rpc(fault)
        assert errors == [f"RuntimeError: injected fault {where}"] * 2
        again = [o async for o in engine.generate("w5 w6", SHORT)][-1].outputs[0].token_ids
        assert again == expected
        await engine.wait_until_idle()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_running == stats.num_waiting == 0


@pytest.mark.anyio
async def test_a_reused_request_id_gets_none_of_the_aborted_requests_tokens(
    tiny_model, shared_manager, anyio_backend
):
    """abort_all() frees the ids at once, while two steps still sample for the old
    requests: their tokens must not reach the new request that took the id."""
    async with async_engine(tiny_model, shared_manager) as engine:
        await engine.collective_rpc(launch_ahead)
        fresh = [o async for o in engine.generate("w6 w7", SHORT)][-1].outputs[0].token_ids
        for _ in range(3):
            async with engine.generate("w3 w4", LONG, request_id="R") as stream:
                async for out in stream:
                    if len(out.outputs[0].token_ids) >= 4:
                        break  # leaves the stream open: abort_all ends it
                engine.abort_all()
                again = [o async for o in engine.generate("w6 w7", SHORT, request_id="R")]
            assert again[-1].outputs[0].token_ids == fresh
        await engine.wait_until_idle()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.anyio
async def test_abort_with_two_steps_in_flight_frees_its_blocks(
    tiny_model, shared_manager, anyio_backend
):
    async with async_engine(tiny_model, shared_manager) as engine:
        await engine.collective_rpc(launch_ahead)
        alone = [o async for o in engine.generate("w8 w9", SHORT)][-1].outputs[0].token_ids
        kept: list[int] = []

        async def keep() -> None:
            async for out in engine.generate("w8 w9", SHORT):
                kept[:] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep)
            async for out in engine.generate("w4 w5", LONG):
                if len(out.outputs[0].token_ids) >= 5:
                    break  # leaving the stream aborts the request
        assert kept == alone
        await engine.wait_until_idle()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_finished.get("abort") == 1


def test_cli_flags_become_engine_options():
    from loomllm.cli.flags import build_parser, engine_options

    def options(*flags: str) -> dict:
        return engine_options(build_parser().parse_args(["serve", "m", *flags]))

    assert options() == {}
    assert options("--async-scheduling", "--enforce-eager") == {
        "async_scheduling": True,
        "enforce_eager": True,
    }
    assert options("--no-async-scheduling") == {"async_scheduling": False}
