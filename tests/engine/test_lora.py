"""LoRA adapters per request: one step mixing three adapters and the base model gives each
request the greedy tokens of transformers with its adapter merged (PEFT checkpoints made by
peft); adapters beyond max_loras wait their turn; the prefix cache never shares KV between
adapters; a bad adapter fails only its request."""

from __future__ import annotations

import anyio
import pytest
from support.models import lora_reference, make_lora_adapter

from loomllm import Engine, LoRARequest, RequestOutput, RequestRefusedError, SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.compute]

MAX_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Forty tokens, so that two requests on it share two full KV blocks, were adapters ignored.
PROMPT = [(7 * i) % 90 + 30 for i in range(40)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("loras")
    return [
        make_lora_adapter(tiny_model, root / "attn", 1, ["q_proj", "v_proj"], lora_alpha=8),
        make_lora_adapter(tiny_model, root / "all", 2, ALL, rank=8, use_rslora=True),
        make_lora_adapter(tiny_model, root / "mlp", 3, ["up_proj", "down_proj"], rank=2),
    ]


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> list[list[int]]:
    """The base model's tokens, then each adapter's."""
    return [lora_reference(tiny_model, a, PROMPT, MAX_TOKENS) for a in [None, *adapters]]


def requests_of(adapters: list[str]) -> list[LoRARequest | None]:
    return [None] + [LoRARequest(f"lora-{i}", i + 1, path) for i, path in enumerate(adapters)]


async def run_all(engine: Engine, loras: list[LoRARequest | None]) -> list[RequestOutput]:
    """Each request on PROMPT, all started together."""
    found: list[RequestOutput | None] = [None] * len(loras)

    async def one(index: int) -> None:
        async with engine.generate(
            {"prompt_token_ids": PROMPT}, GREEDY, lora_request=loras[index]
        ) as stream:
            async for out in stream:
                found[index] = out

    async with anyio.create_task_group() as tg:
        for index in range(len(loras)):
            tg.start_soon(one, index)
    return [out for out in found if out is not None]


@pytest.mark.parametrize("max_loras", [3, 2])
async def test_adapters_mixed_in_one_batch_match_peft_merged(
    tiny_model, shared_manager, adapters, expected, max_loras
):
    """max_loras 3: all in one step; 2: the third adapter waits for a slot (the base model
    needs none), and is loaded over the one its requests are done with."""
    async with Engine(
        tiny_model,
        manager_socket=shared_manager.socket,
        dtype="float32",
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
    ) as e:
        outs = await run_all(e, requests_of(adapters) * 2)  # each twice: prefix-cache hits
        stats = e.stats()
    assert [o.outputs[0].token_ids for o in outs] == expected * 2
    assert len({tuple(tokens) for tokens in expected}) == 4  # every adapter changes the output
    assert stats.prefix_cache_hit_rate > 0  # shared within an adapter, never across


async def test_a_bad_adapter_fails_alone_and_lora_is_refused_where_off(
    tiny_model, shared_manager, adapters, expected, tmp_path
):
    options = {"manager_socket": shared_manager.socket, "dtype": "float32"}
    too_big = make_lora_adapter(tiny_model, tmp_path / "big", 4, ["q_proj"], rank=16)
    async with Engine(tiny_model, **options, enable_lora=True, max_loras=2, max_lora_rank=8) as e:
        bad = [
            LoRARequest("missing", 7, str(tmp_path / "nowhere")),
            LoRARequest("big", 8, too_big),
        ]
        for lora, words in zip(bad, ["cannot read a PEFT adapter", "rank 16"], strict=True):
            async with e.generate("w5 w6", GREEDY, lora_request=lora) as stream:
                with pytest.raises(RequestRefusedError, match=words):
                    async for _ in stream:
                        pass
        outs = await run_all(e, requests_of(adapters[:1]))  # serving on
        assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    async with Engine(tiny_model, **options) as e:
        with pytest.raises(ValueError, match="start it with enable_lora=True"):
            e.generate("w5", GREEDY, lora_request=requests_of(adapters)[1])
    with pytest.raises(ValueError, match="^enable_lora runs transformers' model"):
        Engine(tiny_model, enable_lora=True, quantization="int8")
