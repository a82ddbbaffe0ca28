"""Every architecture loomllm runs, against transformers' eager model: tiny random weights in
float32, logits within 1e-4 on the torch backend (and in Triton's interpreter where the
kernels run it) and greedy tokens through an Engine; any other architecture refused at load.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from support.hf_reference import hf_greedy, hf_logits
from support.models import ARCH_CONFIGS, TINY_VOCAB, make_tiny_arch
from support.paged_forward import paged_logits
from support.streams import final

from loomllm import Engine, SamplingParams
from loomllm.workers.models import architectures
from loomllm.workers.models.loader import load_model

pytestmark = pytest.mark.compute

LOGIT_TOLERANCE = 1e-4
# Prompts longer than the configs' 8-token windows; 40 tokens of context at the last step.
PROMPTS = [[(7 * i + 3) % (TINY_VOCAB - 3) + 3 for i in range(n)] for n in (5, 28)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def arch_model(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_tiny_arch(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_match_transformers(arch_model, backend):
    arch, model_dir = arch_model
    loaded = load_model(model_dir, dtype="float32")
    shape = SimpleNamespace(
        num_key_value_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        num_hidden_layers=loaded.num_layers,
    )
    rng = random.Random(arch)
    tokens = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
    ours = paged_logits(loaded.model, shape, tokens, backend)
    expected = hf_logits(model_dir, tokens)
    assert (ours - expected).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.anyio
async def test_greedy_tokens_match_transformers(arch_model, shared_manager):
    arch, model_dir = arch_model
    expected = hf_greedy(model_dir, PROMPTS, GREEDY.max_tokens, attn_implementation="eager")
    async with Engine(model_dir, manager_socket=shared_manager.socket, dtype="float32") as e:
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            out = await final(e, {"prompt_token_ids": prompt}, GREEDY)
            assert out.outputs[0].token_ids == tokens, arch


def write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path / "config.json"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported;"),
        ({"model_type": "bloom"}, "its model_type 'bloom' is not one loomllm runs"),
        ({"architectures": ["A", "B"]}, "names several architectures"),
    ],
)
def test_other_architectures_are_refused_naming_them_and_the_supported(tmp_path, config, message):
    with pytest.raises(architectures.UnsupportedArchitectureError) as err:
        architectures.check(write_config(tmp_path, config))
    assert message in str(err.value)
    if "not supported" in message:
        assert "loomllm runs LlamaForCausalLM, MistralForCausalLM" in str(err.value)
    assert architectures.check(write_config(tmp_path, {"model_type": "qwen3_moe"})) == (
        "Qwen3MoeForCausalLM"
    )


@pytest.mark.anyio
async def test_an_engine_refuses_one_at_start_and_the_manager_keeps_working(
    tmp_path, shared_manager, tiny_model
):
    """One clear error when the engine starts, not one per request; the next engine runs."""
    transformers.GPT2Config(
        vocab_size=TINY_VOCAB, n_embd=64, n_layer=1, n_head=4, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="GPT2LMHeadModel is not supported") as err:
        async with Engine(str(tmp_path), manager_socket=shared_manager.socket):
            pass
    assert not isinstance(err.value, BaseExceptionGroup)
    async with Engine(tiny_model, manager_socket=shared_manager.socket) as e:
        out = await final(e, {"prompt_token_ids": [5, 6]}, GREEDY)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.anyio
async def test_llama4_context_stops_where_its_chunked_attention_would_bind(
    tmp_path, shared_manager
):
    """Within one chunk, chunked attention is causal attention: the context stops there."""
    model_dir = make_tiny_arch(tmp_path, "llama4_text")
    assert load_model(model_dir, dtype="float32").max_model_len == 64  # its chunk, not 512
    with pytest.raises(ValueError, match="max_model_len=65 exceeds the model's 64"):
        async with Engine(model_dir, manager_socket=shared_manager.socket, max_model_len=65):
            pass
    async with Engine(model_dir, manager_socket=shared_manager.socket, dtype="float32") as e:
        out = await final(e, {"prompt_token_ids": PROMPTS[1]}, GREEDY)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
