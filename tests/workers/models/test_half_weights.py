"""weight_dtype: a float32 model's linear weights in 16 bits, checked against float64 math."""

from __future__ import annotations

import pytest
import torch
from support.paged_forward import paged_logits

from loomllm import Engine, SamplingParams
from loomllm.config import EngineConfig
from loomllm.workers.models.half_weights import (
    MAX_HALF_ROWS,
    HalfWeightLinear,
    store_linear_weights_in,
)
from loomllm.workers.models.loader import load_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, MAX_HALF_ROWS, MAX_HALF_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_half_weight_linear_matches_float64(dtype, rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 80, bias=bias)
    x = torch.randn(1, rows, 96)  # [batch, tokens, features], as HF calls it
    reference = x.double() @ linear.weight.double().T
    if bias:
        reference += linear.bias.double()
    out = HalfWeightLinear(linear, dtype)(x)
    assert out.dtype == torch.float32 and out.shape == (1, rows, 80)
    error = (out.double() - reference).norm() / reference.norm()
    assert error < 1e-2  # 16-bit rounding of weights (and of small-batch activations)
    assert error > 0  # it really rounds: the test would see a no-op


def test_tiny_model_swaps_every_linear_and_stays_close(tiny_model):
    loaded = load_model(tiny_model, dtype="float32")
    exact, config = loaded.model, loaded.config
    half = load_model(tiny_model, dtype="float32", weight_dtype="bfloat16").model
    linears = [m for m in exact.modules() if isinstance(m, torch.nn.Linear)]
    swapped = [m for m in half.modules() if isinstance(m, HalfWeightLinear)]
    assert len(swapped) == len(linears) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in half.modules())
    assert half.model.embed_tokens.weight.dtype == torch.float32  # lookups stay float32
    # A prompt step of 4 rows (the 16-bit path), then a decode step of 1; and a longer
    # prompt (the float32 GEMM path).
    for tokens in ([5, 17, 42, 99, 7], [5, 17, 42, 99, 7, 3, 8, 11, 60, 2]):
        a = paged_logits(exact, config, tokens, "torch").double()
        b = paged_logits(half, config, tokens, "torch").double()
        assert (a - b).norm() / a.norm() < 2e-2


def test_weight_dtype_is_validated():
    with pytest.raises(ValueError, match="weight_dtype must be one of bfloat16, float16 or None"):
        EngineConfig(weight_dtype="int8")
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        load_model("smollm2", weight_dtype="float32")


def test_sixteen_bit_models_keep_their_linears(tiny_model):
    model = load_model(tiny_model, dtype="bfloat16", weight_dtype="float16").model
    assert not any(isinstance(m, HalfWeightLinear) for m in model.modules())


def test_store_ignores_linears_that_are_not_float32():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4))
    assert store_linear_weights_in(model, "float16") == 1
    assert isinstance(model[1], HalfWeightLinear) and isinstance(model[0], torch.nn.Linear)


@pytest.mark.anyio
async def test_engine_serves_with_16_bit_weights(tiny_model, shared_manager):
    options = dict(manager_socket=shared_manager.socket, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42]}
    async with Engine(tiny_model, weight_dtype="bfloat16", **options) as engine:
        kinds = await engine.collective_rpc(lambda w: type(w.loaded.model.lm_head).__name__)
        assert kinds == ["HalfWeightLinear"]
        outs = [o async for o in engine.generate(prompt, params)]
        assert len(outs[-1].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="weight_dtype"):
        Engine(tiny_model, weight_dtype="int4", **options)
