"""Prompt logprobs (SamplingParams.prompt_logprobs) end to end: a real Engine against HF's
log_softmax across chunked prefill, prefix-cache skipping, n > 1 and DELTA, the server's
echo + logprobs (whole and streamed), and bad values. asyncio and trio.
"""

from __future__ import annotations

import anyio
import pytest
from support.servers import NAME, running, sse_events
from support.streams import final

from loomllm import Engine, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio

# 45 tokens: chunked prefill at 16 tokens a step splits it over three steps.
PROMPT_IDS = [(i * 37 + 11) % 250 + 3 for i in range(45)]
PROMPT = {"prompt_token_ids": PROMPT_IDS}
BUDGET = 16  # max_num_batched_tokens
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model):
    """HF's float32 log_softmax at every prompt position: row p predicts token p + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0], dim=-1)


@pytest.fixture
async def chunked_engine(tiny_model, shared_manager):
    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        max_num_batched_tokens=BUDGET,
    ) as e:
        yield e


def check_against_reference(prompt_logprobs, reference, k: int) -> None:
    """Each entry: the prompt token's logprob and rank, and the top-k ids and logprobs."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT_IDS)
    assert prompt_logprobs[0] is None
    for position in range(1, len(PROMPT_IDS)):
        entry, row = prompt_logprobs[position], reference[position - 1]  # row: [V]
        token_id = PROMPT_IDS[position]
        own = entry[token_id]
        expected = row[token_id].item()
        assert abs(own.logprob - expected) < TOL, position
        assert own.decoded_token == f"w{token_id}"
        # Rank 1 = most likely; near-ties (within the tolerance) may go either way.
        best_rank = int((row > expected + TOL).sum()) + 1
        worst_rank = int((row >= expected - TOL).sum())
        assert best_rank <= own.rank <= worst_rank, (position, own.rank)
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), (position, top)
        ref_values = row.topk(k).values.tolist() if k else []
        for (_, tid, logprob), ref_value in zip(top, ref_values, strict=True):
            assert abs(logprob - ref_value) < TOL and abs(logprob - row[tid].item()) < TOL
        assert len(entry) in (k, k + 1)  # the prompt token joins the top-k if not among them


async def test_match_hf_across_prefill_chunks_and_skip_prefix_cache(chunked_engine, reference):
    plain = SamplingParams(temperature=0, max_tokens=2)
    steps_before = chunked_engine.stats().num_steps
    out = await final(
        chunked_engine, PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    )
    assert (
        chunked_engine.stats().num_steps - steps_before >= len(PROMPT_IDS) // BUDGET + 1
    )  # chunked
    check_against_reference(out.prompt_logprobs, reference, 3)
    # The prompt's blocks are cached now: a request without prompt logprobs reads them; one
    # asking for them must not (had it skipped positions, its entries would never complete).
    cached = await final(chunked_engine, PROMPT, plain)
    assert chunked_engine.stats().prefix_cache_hit_rate > 0 and cached.prompt_logprobs is None
    again = await final(
        chunked_engine, PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    )
    check_against_reference(again.prompt_logprobs, reference, 0)
    assert again.outputs[0].token_ids == cached.outputs[0].token_ids


async def test_batched_with_others_n2_and_delta(chunked_engine, reference):
    """n = 2 children share one scoring; DELTA delivers it in the first output only."""
    delta = SamplingParams(
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=5,
        ignore_eos=True,
        prompt_logprobs=2,
        output_kind=RequestOutputKind.DELTA,
    )
    outputs: dict[str, list] = {}

    async def collect(name, prompt, params):
        async with chunked_engine.generate(prompt, params) as stream:
            outputs[name] = [out async for out in stream]

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, "delta", PROMPT, delta)
        tg.start_soon(
            collect,
            "other",
            {"prompt_token_ids": [9] * 30},
            SamplingParams(max_tokens=8, prompt_logprobs=1),
        )
    carrying = [o for o in outputs["delta"] if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs["delta"][0]
    check_against_reference(carrying[0].prompt_logprobs, reference, 2)
    assert sum(len(c.token_ids) for o in outputs["delta"] for c in o.outputs) == 10
    other = outputs["other"][-1]
    assert all(o.prompt_logprobs is not None for o in outputs["other"])  # CUMULATIVE: all
    assert len(other.prompt_logprobs) == 30 and all(e[9].rank for e in other.prompt_logprobs[1:])


async def test_server_echo_with_logprobs(tiny_model, shared_manager):
    prompt_ids = PROMPT_IDS[:20]
    body = {
        "model": NAME,
        "prompt": prompt_ids,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with running(tiny_model, shared_manager) as (engine, client):
        expected = await final(
            engine,
            {"prompt_token_ids": prompt_ids},
            SamplingParams(
                temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2
            ),
        )
        whole = (await client.post("/v1/completions", json=body)).json()
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True}
        ) as response:
            events = await sse_events(response)
    tokens = prompt_ids + expected.outputs[0].token_ids
    rows = expected.prompt_logprobs + expected.outputs[0].logprobs
    lps = whole["choices"][0]["logprobs"]
    assert lps["tokens"] == [f"w{t}" for t in tokens]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["token_logprobs"][1:] == [
        row[t].logprob for t, row in zip(tokens[1:], rows[1:], strict=True)
    ]
    assert all(len(top) in (2, 3) for top in lps["top_logprobs"][1:])
    for top, row in zip(lps["top_logprobs"][1:], rows[1:], strict=True):
        assert top == {lp.decoded_token: lp.logprob for lp in row.values() if lp.rank}
    offsets = [sum(len(f"w{t}") for t in tokens[:i]) for i in range(len(tokens))]
    assert lps["text_offset"] == offsets
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["text"] == whole["choices"][0]["text"][: len(chunks[0]["text"])]
    streamed = {
        key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] for key in lps
    }
    assert streamed == lps
    assert len(chunks[0]["logprobs"]["tokens"]) == len(prompt_ids)  # the echo carries them


def test_scoring_more_rows_than_one_slice():
    """compute_prompt_logprobs works in slices of rows: the seams must not show."""
    import torch

    from loomllm.workers.sample.prompt_logprobs import compute_prompt_logprobs

    logits = torch.randn(2500, 50, generator=torch.Generator().manual_seed(0)).half()  # [N, V]
    targets = torch.arange(2500) % 50
    lps, ranks, top_ids, top_lps = compute_prompt_logprobs(logits, targets, 3)
    ref = logits.float().log_softmax(-1)
    target_ref = ref.gather(1, targets[:, None])  # [N, 1]
    assert torch.equal(lps, target_ref[:, 0])
    assert torch.equal(ranks, (ref >= target_ref).sum(-1))
    assert torch.equal(top_lps, ref.topk(3).values) and top_ids.shape == (2500, 3)
    assert lps.dtype == top_lps.dtype == torch.float32 and ranks.min() >= 1


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs "):
        SamplingParams(prompt_logprobs=value)
