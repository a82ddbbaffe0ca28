"""Speculative decoding (n-gram drafts, verified in the step's one forward): greedy and seeded
outputs token for token those of plain decoding, with chunked prefill, prefix caching and
preemption; unseeded samples drawn from the same distribution (a chi-square test); its
counters; and what it refuses, by name, the engine serving on."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
from scipy.stats import chi2_contingency
from support.models import make_char_model, make_tiny_model

from loomllm import Engine, RequestOutput, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.anyio

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# Repetitive prompts, which the tiny model's greedy output tends to repeat too.
PROMPTS = [
    "w5 w6 w7 w5 w6 w7 w5 w6",
    "w40 w41 w42 w43 w40 w41 w42 w43 w40 w41",
    "w9 w8 w9 w8 w9",
    # A block's worth (16 tokens) in common: the second finds the first's in the prefix cache.
    "w5 w6 w7 " * 6 + "w30",
    "w5 w6 w7 " * 6 + "w31",
]
# The tiny model's KV bytes a block: K and V, 2 layers, 16 tokens, 2 KV heads x 16, fp32.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


async def last_output(stream) -> RequestOutput:
    async with stream:
        return [out async for out in stream][-1]


async def outputs_of(model: str, manager, params: SamplingParams, **options) -> tuple[dict, Engine]:
    """Each prompt's output token ids, all prompts batched together; and the engine, closed."""
    found: dict[int, list[int]] = {}
    async with Engine(model, manager_socket=manager.socket, dtype="float32", **options) as e:

        async def one(index: int) -> None:
            out = await last_output(e.generate(PROMPTS[index], params))
            found[index] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
        stats = e.stats()
    return found, stats


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        # Seeded: a draft is checked against the very draw decoding makes at its position,
        # penalties and min_tokens counting the drafts before it.
        SamplingParams(
            max_tokens=40,
            temperature=0.7,
            top_k=5,
            seed=11,
            repetition_penalty=1.2,
            min_tokens=30,
        ),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},  # prompts chunked beside speculating decodes
        {"kv_cache_memory": 12 * BLOCK_BYTES, "max_model_len": 64},  # preempted, recomputed
        # Step N+1 scheduled while N runs: a request whose drafts are in flight waits.
        {"async_scheduling": True},
    ],
    ids=["plain", "chunked", "preempted", "async"],
)
async def test_speculation_gives_decodings_tokens(tiny_model, shared_manager, params, options):
    plain, _ = await outputs_of(tiny_model, shared_manager, params, **options)
    spec, stats = await outputs_of(
        tiny_model, shared_manager, params, speculative_config=NGRAM, **options
    )
    assert spec == plain
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_drafts > 0
    if params.temperature == 0:
        assert stats.spec_num_accepted_tokens > 0  # drafts were taken: the test binds
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
        assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    if "kv_cache_memory" in options:
        assert stats.num_preemptions > 0
    if not options:
        assert stats.prefix_cache_hit_rate > 0


async def test_sampled_outputs_keep_their_distribution(tiny_model, shared_manager):
    """Unseeded: the three tokens after a prompt the model loops over, with and without
    speculation, as two samples of one distribution (a chi-square test of homogeneity)."""
    options = {"manager_socket": shared_manager.socket, "dtype": "float32", "max_num_seqs": 256}
    async with Engine(tiny_model, **options) as e:
        greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        out = await last_output(e.generate(PROMPTS[0], greedy))
    # The prompt and the model's own continuation: drafts come from its loops.
    prompt = {"prompt_token_ids": out.prompt_token_ids + out.outputs[0].token_ids}
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    draws = 2000

    async def sample(**more: object) -> tuple[Counter, object]:
        counts: Counter = Counter()
        async with Engine(tiny_model, **options, **more) as e:

            async def one(_: int) -> None:
                out = await last_output(e.generate(prompt, params))
                counts[tuple(out.outputs[0].token_ids)] += 1

            async with anyio.create_task_group() as tg:
                for i in range(draws):
                    tg.start_soon(one, i)
            return counts, e.stats()

    plain, _ = await sample()
    spec, stats = await sample(speculative_config=NGRAM)
    assert stats.spec_num_accepted_tokens > draws // 10  # many outputs went through a draft
    outcomes = sorted(set(plain) | set(spec))
    assert 2 <= len(outcomes) <= 8  # top_k=2 over three tokens
    table = [[plain[o] for o in outcomes], [spec[o] for o in outcomes]]
    assert chi2_contingency(table).pvalue > 1e-3, (plain, spec)


async def test_what_speculation_refuses_is_named_and_the_engine_serves_on(
    tiny_model, shared_manager
):
    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        speculative_config=NGRAM,
    ) as e:
        with pytest.raises(ValueError, match="structured_outputs do not work with speculative"):
            grammar = StructuredOutputsParams(choice=["w5", "w6"])
            e.generate("w5", SamplingParams(max_tokens=2, structured_outputs=grammar))
        with pytest.raises(ValueError, match="logprobs do not work with speculative"):
            e.generate("w5", SamplingParams(max_tokens=2, logprobs=1))
        out = await last_output(e.generate("w5 w6 w5 w6", SamplingParams(max_tokens=8)))
        assert len(out.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="'draft_model' needs a model"):
        Engine(
            tiny_model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}
        )


async def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(
    tiny_model, shared_manager
):
    """Drafts accepted together past a stop string: the output ends where it completes, its
    token ids and text those of plain decoding."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, _ = await outputs_of(tiny_model, shared_manager, greedy)
    options = {"manager_socket": shared_manager.socket, "dtype": "float32"}
    async with Engine(tiny_model, **options) as e:
        text = (await last_output(e.generate(PROMPTS[0], greedy))).outputs[0].text
    stop = text.split()[len(text.split()) // 2]  # a word from the middle of the answer
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    found = []
    for more in ({}, {"speculative_config": NGRAM}):
        async with Engine(tiny_model, **options, **more) as e:
            out = (await last_output(e.generate(PROMPTS[0], params))).outputs[0]
            found.append((out.token_ids, out.text, out.finish_reason, out.stop_reason))
    assert found[0] == found[1]
    assert found[0][2:] == ("stop", stop) and len(found[0][0]) < len(plain[0])


@pytest.mark.parametrize("draft_seed", [0, 9], ids=["itself", "another"])
async def test_a_draft_models_drafts_give_decodings_tokens(
    tiny_model, shared_manager, tmp_path, draft_seed
):
    """A draft model (the target itself: every draft taken; another random model with its
    vocabulary: few) drafts greedily; the output is plain decoding's, greedy and seeded."""
    draft = tiny_model if draft_seed == 0 else make_tiny_model(tmp_path / "draft", seed=draft_seed)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    for params in (
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
    ):
        plain, _ = await outputs_of(tiny_model, shared_manager, params)
        drafted, stats = await outputs_of(
            tiny_model, shared_manager, params, speculative_config=spec
        )
        assert drafted == plain
        assert stats.spec_num_draft_tokens > 0
        if draft_seed == 0 and params.temperature == 0:
            # Its own greedy tokens: every draft is right (a step's budget may cut some).
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


async def test_a_draft_model_with_another_vocabulary_is_refused(
    tiny_model, shared_manager, tmp_path
):
    other = make_char_model(tmp_path / "chars")  # single characters: another vocabulary
    spec = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        async with Engine(
            tiny_model,
            manager_socket=shared_manager.socket,
            dtype="float32",
            speculative_config=spec,
        ):
            pass


def test_a_draft_model_has_its_share_of_the_gpu_set_aside():
    """On CUDA the target's workers size their KV cache first: to gpu_memory_utilization
    less the draft's share, which the draft's worker, sizing second, then finds free (with
    the whole utilization, the target's cache left it a negative budget)."""
    from loomllm.config import EngineConfig
    from loomllm.workers.runner.kv_sizing import gpu_kv_budget

    draft = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}

    def target_share(spec: dict | None, utilization: float = 0.9) -> float:
        config = EngineConfig(
            model="m", speculative_config=spec, gpu_memory_utilization=utilization
        )
        return config.worker_spec().options.gpu_memory_utilization

    assert target_share(draft) == pytest.approx(0.8)
    assert target_share({**draft, "draft_gpu_memory_fraction": 0.3}, 0.95) == pytest.approx(0.65)
    assert target_share(NGRAM) == target_share(None) == 0.9
    total, draft_weights, peak = 80e9, 2.5e9, 0.5e9
    target_fills = target_share(draft) * total  # its weights, KV cache and activations
    left = gpu_kv_budget(total, total - target_fills - draft_weights, peak, 0.9)
    assert left == pytest.approx(0.1 * total - draft_weights - peak)
