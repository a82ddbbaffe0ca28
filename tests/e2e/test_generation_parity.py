"""Greedy parity with Hugging Face: our batched, paged, chunked, cached, preempted
generation gives exactly the tokens of `generate(do_sample=False)` run one prompt at a time.

Tiny random-weight models of several architectures (built here), with async scheduling off
and on, and the real SmolLM2.
"""

from __future__ import annotations

import random

import anyio
import pytest
from support.hf_reference import hf_greedy
from support.models import make_tiny_model, preempting_smollm2
from support.streams import final

from loomllm import Engine, SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.compute]

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ["llama", "qwen2", "qwen3"]


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 prompts of different lengths; the last four share a 40-token prefix."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33)]
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 16, 30)]
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    prompts = make_prompts(256)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Each case with one step in flight, and with two (async scheduling)."""
    return request.param


async def generate_all(engine: Engine, prompts: list[list[int]], staggered: bool = False):
    results: list[list[int] | None] = [None] * len(prompts)

    async def one(i: int, started: anyio.Event) -> None:
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, GREEDY):
            started.set()
            results[i] = out.outputs[0].token_ids
        started.set()

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            started = anyio.Event()
            tg.start_soon(one, i, started)
            if staggered:  # the next request arrives while this one is mid-flight
                await started.wait()
    return results


async def test_together_staggered_and_cached(arch_case, shared_manager, async_scheduling):
    model_dir, prompts, expected = arch_case
    async with Engine(
        model_dir,
        manager_socket=shared_manager.socket,
        dtype="float32",
        async_scheduling=async_scheduling,
    ) as e:
        assert await generate_all(e, prompts) == expected
        assert await generate_all(e, prompts, staggered=True) == expected
        # The second and third rounds hit the prefix cache for every full block.
        assert e.stats().prefix_cache_hit_rate > 0
        assert e.stats().num_free_blocks == e.stats().num_total_blocks


async def test_chunked_prefill(arch_case, shared_manager, async_scheduling):
    model_dir, prompts, expected = arch_case
    async with Engine(
        model_dir,
        manager_socket=shared_manager.socket,
        dtype="float32",
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    ) as e:
        assert await generate_all(e, prompts) == expected


async def test_preemption_under_a_tiny_kv_cache(arch_case, shared_manager, async_scheduling):
    model_dir, prompts, expected = arch_case
    # 8 blocks of 16 tokens: the longest request needs 102 tokens (7 blocks), so the
    # batch cannot all be resident and requests are preempted and recomputed.
    async with Engine(
        model_dir,
        manager_socket=shared_manager.socket,
        dtype="float32",
        kv_cache_memory=8 * 8192,
        max_model_len=128,
        async_scheduling=async_scheduling,
    ) as e:
        assert e.stats().num_total_blocks == 8
        assert await generate_all(e, prompts) == expected
        assert e.stats().num_preemptions > 0
        assert e.stats().num_free_blocks == 8


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three uses of copper:",
    "The quick brown fox",
    "Translate to French: I would like a cup of coffee, please.",
    "In 1969, the first humans to walk on the Moon were",
    "Q: What is 12 times 12?\nA:",
]
SYSTEM = "You are a concise assistant. Answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def smollm2_case():
    from loomllm.text.tokenizer import Tokenizer
    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    model_dir = str(prepare_model_dir(resolve_model("smollm2"), dense_weights=True))
    tok = Tokenizer.from_model_dir(model_dir)
    # The last four share a long system prefix: prefix-cache hits across requests.
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:4]]
    prompts += [tok.encode(SYSTEM + p) for p in SMOL_PROMPTS[4:]]
    return prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.slow
async def test_smollm2_greedy_parity(smollm2_case, shared_manager):
    """Together, then staggered (prefix-cache hits): the same greedy tokens as HF."""
    prompts, expected = smollm2_case
    async with Engine(
        "smollm2", manager_socket=shared_manager.socket, dtype="float32", quantization="none"
    ) as e:
        assert await generate_all(e, prompts) == expected
        assert await generate_all(e, prompts, staggered=True) == expected
        assert e.stats().prefix_cache_hit_rate > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_smollm2_run_as_stored_stays_near_the_dequantized_model(
    dtype, smollm2_case, shared_manager
):
    """The GGUF's Q4_1 blocks, run as stored (activations quantized to int8 per 32, as
    llama.cpp computes): each token's logprob of HF's own greedy text near that of HF's
    float32 model on transformers' dequantization. Greedy tokens are not compared: the
    activations' rounding moves near-ties."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    prompts, expected = smollm2_case
    texts = [p + want for p, want in zip(prompts[:3], expected[:3], strict=True)]
    model_dir = prepare_model_dir(resolve_model("smollm2"), dense_weights=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [
            hf(torch.tensor([t])).logits[0, :-1].log_softmax(-1)[range(len(t) - 1), t[1:]].numpy()
            for t in texts
        ]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    async with Engine(
        "smollm2", manager_socket=shared_manager.socket, dtype=dtype, max_model_len=256
    ) as e:
        outs = [await final(e, {"prompt_token_ids": t}, params) for t in texts]
    got = [np.array([next(iter(r.values())).logprob for r in o.prompt_logprobs[1:]]) for o in outs]
    # The int8 activations move each logprob by a few hundredths of a nat on average (as
    # llama.cpp's do: its perplexity on this file is within 0.1% of ours); a wrong block, row
    # or scale moves them by nats.
    assert np.abs(np.concatenate(got) - np.concatenate(want)).mean() < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_smollm2_greedy_parity_chunked_and_preempted(
    smollm2_case, shared_manager, async_scheduling
):
    """Chunked prefill under a KV cache so small that requests are preempted and recomputed,
    with async scheduling off and on: HF's greedy tokens. Through the blocking LLM, whose
    event loop is its own: once, not again under each anyio backend (the model's most
    expensive runs here; the tiny models' cases run under both)."""
    prompts, expected = smollm2_case
    with preempting_smollm2(shared_manager, 10, 24, async_scheduling) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        stats = llm.engine.stats()
        assert stats.num_total_blocks == 10 and stats.num_preemptions > 0
