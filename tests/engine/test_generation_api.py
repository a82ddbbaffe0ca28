"""The generation API on a tiny model: sampling semantics end to end, logprobs against HF,
stop strings, output kinds, n > 1, cancellation and bad input. asyncio and trio.
"""

from __future__ import annotations

import math

import anyio
import anyio.lowlevel
import pytest
from support.hf_reference import hf_greedy
from support.streams import final

from loomllm import Engine, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3]}
OTHER = {"prompt_token_ids": [11, 12, 13]}


async def test_temperature_zero_and_top_k_one_equal_greedy(engine):
    greedy = await final(engine, PROMPT, SamplingParams(temperature=0, max_tokens=12))
    top1 = await final(engine, PROMPT, SamplingParams(temperature=1.5, top_k=1, max_tokens=12))
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


async def test_seeded_request_ignores_batch_companions(engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = await final(engine, PROMPT, params)
    results = {}

    async def run(name, prompt, p):
        results[name] = await final(engine, prompt, p)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "seeded", PROMPT, params)
        for i in range(3):
            tg.start_soon(run, f"other{i}", OTHER, SamplingParams(temperature=1.0, max_tokens=20))
    assert results["seeded"].outputs[0].token_ids == alone.outputs[0].token_ids
    different = await final(
        engine, PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


async def test_logprobs_match_hf_log_softmax(engine, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    out = await final(
        engine, PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    )
    completion = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT["prompt_token_ids"] + completion.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    start = len(PROMPT["prompt_token_ids"]) - 1
    total = 0.0
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    for step, (token_id, entry) in enumerate(pairs):
        row = ref[start + step]
        assert abs(entry[token_id].logprob - row[token_id].item()) < 1e-4
        top = torch.topk(row, 3)
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank is not None)
        assert [tid for _, tid in ranked] == top.indices.tolist()
        total += row[token_id].item()
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)


async def test_cumulative_logprob_is_given_where_logprobs_are_asked_for(engine):
    """As vLLM's: None without `logprobs` (the greedy kernel skips them), alone or beside a
    request that asks; with `logprobs=0`, the sum of the tokens' logprobs."""
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = await final(engine, PROMPT, plain)
    assert alone.outputs[0].cumulative_logprob is None and alone.outputs[0].logprobs is None
    results = {}

    async def run(name, p):
        results[name] = await final(engine, PROMPT, p)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "plain", plain)
        tg.start_soon(
            run, "asked", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        )
    asked = results["asked"].outputs[0]
    assert results["plain"].outputs[0].cumulative_logprob is None
    assert results["plain"].outputs[0].token_ids == asked.token_ids == alone.outputs[0].token_ids
    total = sum(
        entry[tid].logprob for tid, entry in zip(asked.token_ids, asked.logprobs, strict=True)
    )
    assert asked.cumulative_logprob < 0 and math.isclose(
        asked.cumulative_logprob, total, abs_tol=1e-4
    )


async def test_logit_bias_and_allowed_token_ids_match_hf_generate(engine, tiny_model):
    """Greedy tokens with a bias and with an allowed list, batched beside a plain request,
    against HF generate's sequence_bias and prefix_allowed_tokens_fn one at a time."""
    prompts = [PROMPT["prompt_token_ids"]]
    # Bias the tokens the plain run picks, so that the bias must show.
    picked = hf_greedy(tiny_model, prompts, 12)[0]
    bias = {picked[0]: -5.0, picked[3]: -2.5, 77: 1.5}
    allowed = [2, 9, 30, 77, 150, picked[5]]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    cases = {
        "plain": (SamplingParams(**greedy), {}),
        "bias": (
            SamplingParams(**greedy, logit_bias=bias),
            {"sequence_bias": {(t,): b for t, b in bias.items()}},
        ),
        "allowed": (
            SamplingParams(**greedy, allowed_token_ids=allowed),
            {"prefix_allowed_tokens_fn": lambda batch, ids: allowed},
        ),
    }
    got = {}

    async def run(name, params):
        got[name] = (await final(engine, PROMPT, params)).outputs[0].token_ids

    async with anyio.create_task_group() as tg:
        for name, (params, _) in cases.items():
            tg.start_soon(run, name, params)
    for name, (_, hf_kwargs) in cases.items():
        assert [got[name]] == hf_greedy(tiny_model, prompts, 12, **hf_kwargs), name
    assert got["bias"] != got["plain"] and set(got["allowed"]) <= set(allowed)


async def test_bad_words_match_hf_generate(engine, tiny_model):
    """bad_words (words, encoded by the engine), and sequences given as ids, against HF
    generate's bad_words_ids: a word's last token is banned where the output ends with the
    rest of it. The tiny vocabulary is whole words: "w5 w6" is [5, 6]."""
    prompts = [PROMPT["prompt_token_ids"]]
    picked = hf_greedy(tiny_model, prompts, 12)[0]
    assert picked[3] != prompts[0][-1]  # HF also looks at the prompt; the engine does not
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    cases = {
        "word": ([f"w{picked[2]}"], (), [[picked[2]]]),
        "two tokens": ([f" w{picked[3]} w{picked[4]}"], (), [[picked[3], picked[4]]]),
        "ids": ((), [[picked[1]], [picked[5], picked[6]]], [[picked[1]], [picked[5], picked[6]]]),
    }
    for name, (words, ids, hf_ids) in cases.items():
        params = SamplingParams(**greedy, bad_words=words, bad_words_token_ids=ids)
        got = (await final(engine, PROMPT, params)).outputs[0].token_ids
        assert [got] == hf_greedy(tiny_model, prompts, 12, bad_words_ids=hf_ids), name
        assert got != picked, name


async def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny_model, shared_manager):
    long = [5 + i % 90 for i in range(40)]
    greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
    async with Engine(
        tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_model_len=32
    ) as e:
        with pytest.raises(ValueError, match="max_model_len"):
            e.generate({"prompt_token_ids": long}, SamplingParams(**greedy))
        cut = await final(
            e, {"prompt_token_ids": long}, SamplingParams(**greedy, truncate_prompt_tokens=10)
        )
        same = await final(e, {"prompt_token_ids": long[-10:]}, SamplingParams(**greedy))
        assert cut.prompt_token_ids == long[-10:]
        assert cut.outputs[0].token_ids == same.outputs[0].token_ids
        text = " ".join(f"w{t}" for t in long)
        most = await final(e, text, SamplingParams(**greedy, truncate_prompt_tokens=-1))
        assert most.prompt_token_ids == long[-29:]  # room for max_tokens (3)
        assert most.prompt == " ".join(f"w{t}" for t in long[-29:])
        assert len(most.outputs[0].token_ids) == 3
        with pytest.raises(ValueError, match="^truncate_prompt_tokens .32. must be below"):
            e.generate(text, SamplingParams(**greedy, truncate_prompt_tokens=32))
        short = await final(
            e, {"prompt_token_ids": long[:4]}, SamplingParams(**greedy, truncate_prompt_tokens=10)
        )
        assert short.prompt_token_ids == long[:4]


def test_truncation_keeps_a_text_prompts_bos_first():
    from loomllm.engine.input_checks import truncated

    params = SamplingParams(truncate_prompt_tokens=3)
    assert truncated([1, 7, 8, 9, 10], params, 32, bos=1) == [1, 9, 10]
    assert truncated([7, 8, 9, 10], params, 32, bos=1) == [8, 9, 10]
    assert truncated([1, 7, 8, 9, 10], params, 32, bos=None) == [8, 9, 10]  # ids as given
    assert truncated([1, 7], params, 32, bos=1) == [1, 7]


async def test_output_kinds_agree(engine):
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind)
        outputs[kind] = [o async for o in engine.generate(PROMPT, params)]
    cumulative = outputs[RequestOutputKind.CUMULATIVE]
    assert len(outputs[RequestOutputKind.FINAL_ONLY]) == 1
    final_out = outputs[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    assert final_out.text == cumulative[-1].outputs[0].text
    assert final_out.token_ids == cumulative[-1].outputs[0].token_ids
    deltas = outputs[RequestOutputKind.DELTA]
    assert "".join(d.outputs[0].text for d in deltas) == final_out.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final_out.token_ids
    assert (await final(engine, PROMPT, base)).outputs[0].token_ids == final_out.token_ids


async def test_n_samples_share_a_prompt(engine):
    out = await final(
        engine, PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    again = await final(
        engine, PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    )
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


async def test_num_cached_tokens_counts_prefix_cache_hits(engine):
    prompt = {"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(40)]}  # 2 full blocks + 8
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = await final(engine, prompt, params)
    second = await final(engine, prompt, params)
    block = engine.model_info.block_size
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (40 // block) * block > 0


async def test_stop_string_across_tokens_never_leaks(engine):
    greedy = await final(
        engine, PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    text = greedy.outputs[0].text  # words like " w124 w61 ..."
    words = text.split()
    # A stop string that starts inside one token and ends inside the next.
    stop = words[3][1:] + " " + words[4][:2]
    params = SamplingParams(
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        stop=[stop],
        output_kind=RequestOutputKind.DELTA,
    )
    deltas = [o async for o in engine.generate(PROMPT, params)]
    streamed = "".join(d.outputs[0].text for d in deltas)
    assert stop not in streamed and streamed == text[: text.index(stop)]
    assert deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == stop
    included = await final(
        engine,
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert included.outputs[0].text == text[: text.index(stop) + len(stop)]


async def test_stop_token_ids_and_min_tokens(engine):
    greedy = await final(
        engine, PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    third = greedy.outputs[0].token_ids[2]
    out = await final(
        engine,
        PROMPT,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third], ignore_eos=True),
    )
    first_at = greedy.outputs[0].token_ids.index(third)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids[: first_at + 1]
    assert out.outputs[0].stop_reason == third and out.outputs[0].finish_reason == "stop"
    held = await final(
        engine,
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=12,
            stop_token_ids=[third],
            min_tokens=first_at + 2,
            ignore_eos=True,
        ),
    )
    assert third not in held.outputs[0].token_ids[: first_at + 2]  # banned until min_tokens


async def _blocks_back(engine: Engine, free_before: int) -> None:
    with anyio.fail_after(10):
        await engine.wait_until_idle()
    assert engine.stats().num_free_blocks == free_before
    assert engine.stats().num_running == 0


@pytest.mark.parametrize("kind", list(RequestOutputKind))
async def test_abort_by_id_ends_the_stream_with_finish_reason_abort(engine, kind):
    free_before = engine.stats().num_free_blocks
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, n=2, output_kind=kind)
    stream = engine.generate(PROMPT, long, request_id="by-id")
    if kind != RequestOutputKind.FINAL_ONLY:
        await stream.__anext__()  # it runs
    engine.abort("by-id")
    with anyio.fail_after(10):
        outputs = [out async for out in stream]
    assert outputs[-1].finished
    assert {c.finish_reason for c in outputs[-1].outputs} == {"abort"}
    await _blocks_back(engine, free_before)


async def test_consumer_leaving_aborts_the_request(engine):
    free_before = engine.stats().num_free_blocks
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    # 1: break after 3 chunks
    count = 0
    async for _ in engine.generate(PROMPT, long):
        count += 1
        if count == 3:
            break
    await _blocks_back(engine, free_before)
    # 2: a deadline
    with anyio.move_on_after(0.3):
        async for _ in engine.generate(PROMPT, long):
            pass
    await _blocks_back(engine, free_before)
    # 3: the consumer's task group is cancelled
    async with anyio.create_task_group() as tg:

        async def consume(task_status=anyio.TASK_STATUS_IGNORED):
            async for _ in engine.generate(OTHER, long):
                task_status.started()

        await tg.start(consume)
        tg.cancel_scope.cancel()
    await _blocks_back(engine, free_before)
    assert engine.stats().num_waiting == 0


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt must not be empty"),
        ({"prompt_token_ids": [1] * 600}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [100000]}, SamplingParams(), "prompt_token_ids"),
        (42, SamplingParams(), "prompt must be"),
        ("w5 \ud800", SamplingParams(), "lone surrogate '\\\\ud800' at index 3"),
        # Out of the vocabulary, banned until min_tokens: it failed the whole step once.
        (
            PROMPT,
            SamplingParams(min_tokens=2, stop_token_ids=[100000]),
            r"^stop_token_ids must be token ids in \[0, ",
        ),
        (PROMPT, SamplingParams(logit_bias={100000: 1.0}), r"^logit_bias must be token ids"),
        (PROMPT, SamplingParams(allowed_token_ids=[5, 100000]), r"^allowed_token_ids must be"),
        # eos (2) and the stop ids are banned until min_tokens: nothing would be left.
        (
            PROMPT,
            SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1),
            "nothing is left to sample",
        ),
        (
            PROMPT,
            SamplingParams(stop_token_ids=list(range(256)), min_tokens=1),
            "stop_token_ids and eos cover the vocabulary",
        ),
    ],
)
async def test_bad_prompts_fail_clearly_and_others_continue(engine, prompt, params, match):
    async def good():
        return await final(
            engine, PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        )

    async with anyio.create_task_group() as tg:
        results = []
        tg.start_soon(lambda: _append(results, good()))
        with pytest.raises(ValueError, match=match):
            await final(engine, prompt, params)
    assert len(results[0].outputs[0].token_ids) == 20


@pytest.mark.parametrize("request_id", [5, 2.5, b"id", ("a",), True, "w\ud800"])
async def test_bad_request_ids_fail_clearly_and_others_continue(engine, request_id):
    """The id crosses the wire to the workers: a non-string or a lone surrogate failed the
    next step's frame, which ended the engine and every request in it."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        results = []
        tg.start_soon(lambda: _append(results, final(engine, PROMPT, params)))
        with pytest.raises(ValueError, match="^request_id must be a string"):
            engine.generate(PROMPT, params, request_id=request_id)
    assert len(results[0].outputs[0].token_ids) == 20


async def test_stop_strings_stay_in_this_process(engine):
    """Stop strings are the output processor's: the workers never get them, so none can
    fail a step's frame (a lone surrogate could not be encoded; one of 70 MB outgrew it)."""
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, stop=["\ud800", "x" * 100_000]
    )
    stream = engine.generate(PROMPT, params, request_id="stops")
    first = await stream.__anext__()
    (replica,) = engine._replicas
    assert replica.core.scheduler.requests["stops"].sampling_params.stop == ()
    rest = [out async for out in stream]
    assert (rest or [first])[-1].outputs[0].finish_reason == "length"


async def test_generate_while_the_engine_closes_is_refused_not_left_waiting(
    tiny_model, shared_manager
):
    """Another task's generate() once the owner is leaving `async with`: EngineClosedError,
    or a stream that ends; never one added to a step loop that has ended (it waited forever)."""
    from loomllm.errors import EngineClosedError

    outcomes = []
    leaving = anyio.Event()

    async def one(engine):
        try:
            stream = engine.generate(PROMPT, SamplingParams(max_tokens=2))
        except EngineClosedError:
            outcomes.append("refused")
            return
        with anyio.fail_after(10):
            try:
                outs = [out async for out in stream]
                outcomes.append(outs[-1].outputs[0].finish_reason if outs else "no output")
            except EngineClosedError:
                outcomes.append("refused")

    async def caller(engine):
        await leaving.wait()
        async with anyio.create_task_group() as tg:
            for _ in range(200):  # across the whole exit
                tg.start_soon(one, engine)
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        async with Engine(
            tiny_model, manager_socket=shared_manager.socket, dtype="float32"
        ) as engine:
            tg.start_soon(caller, engine)
            await anyio.sleep(0.05)
            leaving.set()
    assert len(outcomes) == 200 and set(outcomes) <= {"refused", "length", "abort"}, outcomes


async def _append(results, coro):
    results.append(await coro)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-3), "top_k"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(logit_bias={5: 10**400}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(bad_words=["ok", " "]), "bad_words"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[[1, -1]]), "bad_words_token_ids"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


async def test_max_tokens_beyond_context_stops_at_max_model_len(tiny_model, shared_manager):
    async with Engine(
        tiny_model, manager_socket=shared_manager.socket, dtype="float32", max_model_len=20
    ) as e:
        out = await final(
            e, PROMPT, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        )
    assert out.outputs[0].finish_reason == "length"
    assert len(PROMPT["prompt_token_ids"]) + len(out.outputs[0].token_ids) == 20


async def test_a_stream_left_after_its_end_never_aborts_the_next_request_of_its_id(engine):
    """A stream closed (or collected) with its final output unread aborts its own request
    only: not a new one that took the id meanwhile."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.generate(PROMPT, params, request_id="x")
    await engine.wait_until_idle()  # "x" has finished; its last output waits unread
    first.close()  # the consumer leaves without it: an abort of "x" is queued
    # The id is free: this "x" is new, and starts before the queued abort applies.
    second = [out async for out in engine.generate(PROMPT, params, request_id="x")][-1]
    assert second.outputs[0].finish_reason == "length"
    assert second.outputs[0].token_ids == (await final(engine, PROMPT, params)).outputs[0].token_ids


async def test_duplicate_request_id_is_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    first = engine.generate(PROMPT, params, request_id="same")
    await first.__anext__()
    with pytest.raises(ValueError, match="already running"):
        await engine.generate(PROMPT, params, request_id="same").__anext__()
    await first.aclose()


def test_integers_beyond_64_bits_are_refused():
    with pytest.raises(ValueError, match="^seed must fit in 64 bits"):
        SamplingParams(seed=2**100)
    # Choice i of n samples with seed + i: the last must fit too (it failed after the first
    # was scheduled, which then ran for no one).
    with pytest.raises(ValueError, match="^seed \\+ n - 1 must fit in 64 bits"):
        SamplingParams(seed=2**63 - 1, n=2)
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2
    for huge in (2**70, 10**400):  # number fields: msgpack cannot carry them, float overflows
        with pytest.raises(ValueError, match="^temperature must be a finite number"):
            SamplingParams(temperature=huge)
    with pytest.raises(ValueError, match="^top_p must be a finite number"):
        SamplingParams(top_p=float("nan"))


def test_a_requests_children_share_its_checked_params(monkeypatch):
    """n children of a full vocabulary's bias were each checked (and copied) again: seconds
    of the event loop, and n copies in memory, for one request."""
    from loomllm.protocols.sampling import replace_checked

    params = SamplingParams(n=3, seed=5, logit_bias={t: 1.0 for t in range(1000)})
    monkeypatch.setattr(SamplingParams, "_validate", lambda self: pytest.fail("checked again"))
    child = replace_checked(params, n=1, seed=7)
    assert (child.n, child.seed, params.n, params.seed) == (1, 7, 3, 5)
    assert child.logit_bias is params.logit_bias
