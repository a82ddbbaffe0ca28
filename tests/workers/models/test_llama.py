"""loomllm's own Llama-family decoder (models/llama/): its logits against transformers'
own model on the same checkpoint (stock eager attention, no paged cache: an independent
reference), with torch's ops and with the fused kernels and Triton attention (in Triton's
interpreter); which configs it takes; clear errors for checkpoints that do not fit; and
the worker's imports it spares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.hf_reference import hf_logits
from support.kernel_count import decode_layer_launches
from support.models import COMMON, LLAMA3_ROPE, PROMPT, VARIANTS, save_variant
from support.paged_forward import paged_logits

from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.attention import paged as attention
from loomllm.workers.attention import triton_kernels as ta
from loomllm.workers.kernels import fused_ops
from loomllm.workers.models.fused_layers import install_fused_ops
from loomllm.workers.models.llama import config as llama_config
from loomllm.workers.models.llama import model as llama_family
from loomllm.workers.models.llama import weights as llama_weights
from loomllm.workers.models.loader import load_model
from loomllm.workers.models.sources import ModelLoadError
from loomllm.workers.runner.model_runner import ModelRunner

pytestmark = pytest.mark.compute


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_dir(request, tmp_path_factory) -> Path:
    return save_variant(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_transformers(variant_dir):
    loaded = load_model(str(variant_dir), dtype="float32", model_impl="loom")
    assert isinstance(loaded.model, llama_family.LlamaFamilyForCausalLM)
    ours = paged_logits(loaded.model, loaded.config, PROMPT, "torch")
    torch.testing.assert_close(ours, hf_logits(variant_dir, PROMPT), rtol=1e-4, atol=1e-5)


def test_a_plain_batched_forward_matches_transformers(variant_dir):
    """No KV cache, two rows (the checks' forward), on a model built from transformers'
    state dict in memory."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        variant_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    shape, _ = llama_config.read_shape(variant_dir / "config.json")
    ours = llama_weights.build(shape, torch.float32, torch.device("cpu"), variant_dir, "dummy")
    llama_weights.copy_weights(ours, theirs.state_dict().items())
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_fused_kernels_and_triton_attention_match_transformers(variant, tmp_path):
    """The CUDA path's kernels, in Triton's interpreter (conftest.py): qwen3's norms of q
    and k run the RMSNorm kernel over head-sized rows."""
    model_dir = save_variant(tmp_path, variant)
    loaded = load_model(str(model_dir), dtype="float32", model_impl="loom")
    fused = install_fused_ops(loaded.model)
    norms = (
        2 * COMMON["num_hidden_layers"]
        + 1
        + (2 * COMMON["num_hidden_layers"] if variant == "qwen3" else 0)
    )
    assert fused == (norms, 1, COMMON["num_hidden_layers"])
    ours = paged_logits(loaded.model, loaded.config, PROMPT[:12], "triton")
    torch.testing.assert_close(ours, hf_logits(model_dir, PROMPT[:12]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_rotary_into_the_cache_is_bit_for_bit_the_two_kernels(variant, tmp_path, monkeypatch):
    """bf16, fused, Triton attention: the rotary embedding and the K/V write in one kernel
    (the prompt's step), or in the decode attention's kernel (a decode-only step), give the
    logits of the rotary kernel then write_kv (where the fused ones decline)."""
    loaded = load_model(str(save_variant(tmp_path, variant)), dtype="bfloat16", model_impl="loom")
    install_fused_ops(loaded.model)
    calls = []

    def counting(name: str, original):
        def counted(*args):
            out = original(*args)
            calls.extend([name] * (out is not None))  # attend_rotating declines a prompt
            return out

        return counted

    for module, name in ((fused_ops, "rotary_into_cache"), (attention, "attend_rotating")):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    fused = paged_logits(loaded.model, loaded.config, PROMPT, "triton", torch.bfloat16)
    layers = COMMON["num_hidden_layers"]
    assert sorted(calls) == ["attend_rotating"] * layers + ["rotary_into_cache"] * layers
    monkeypatch.setattr(fused_ops, "rotary_into_cache_fits", lambda *args: False)
    assert torch.equal(
        fused, paged_logits(loaded.model, loaded.config, PROMPT, "triton", torch.bfloat16)
    )
    assert len(calls) == 2 * layers


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "llama-biases-tied"])
def test_bfloat16_logits_are_transformers_bit_for_bit(variant, tmp_path):
    """In bf16, against transformers' model running our paged attention (the same on both
    sides): every rounding of the model's own arithmetic is transformers' (at these shapes
    the packed q|k|v and gate|up matmuls round as the separate ones do)."""
    model_dir = save_variant(tmp_path, variant)
    ours = load_model(str(model_dir), dtype="bfloat16", model_impl="loom")
    theirs = load_model(str(model_dir), dtype="bfloat16", model_impl="transformers").model
    attention.route_transformers_model(theirs)
    assert ours.dtype == "bfloat16"
    expected = paged_logits(theirs, ours.config, PROMPT, "torch")
    assert torch.equal(paged_logits(ours.model, ours.config, PROMPT, "torch"), expected)


def test_auto_picks_it_for_the_llama_family_and_transformers_otherwise(tmp_path):
    model_dir = save_variant(tmp_path / "llama", "llama")
    assert isinstance(
        load_model(str(model_dir), dtype="float32").model, llama_family.LlamaFamilyForCausalLM
    )
    hf = load_model(str(model_dir), dtype="float32", model_impl="transformers")
    assert type(hf.model).__name__ == "LlamaForCausalLM"
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 128,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    assert type(load_model(str(model_dir), dtype="float32").model).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="model_impl='loom' cannot run .*RoPE type 'yarn'"):
        load_model(str(model_dir), dtype="float32", model_impl="loom")
    with pytest.raises(ValueError, match="model_impl must be one of auto, loom, transformers"):
        load_model(str(model_dir), model_impl="vllm")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "RoPE type 'dynamic'",
        ),
        ({"hidden_size": None}, "does not give hidden_size"),
        ({"num_attention_heads": 3}, "3 attention heads over 2 KV heads"),
        ({"model_type": "mistral"}, "model_type 'mistral' with architectures ['LlamaForCausalLM']"),
        (
            {
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "linear", "factor": 4.0},
            },
            "differ",
        ),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 RoPE without low_freq_factor, high_freq_factor",
        ),
        (
            {
                "rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 64},
                "original_max_position_embeddings": 32,
            },
            "two original_max_position_embeddings",
        ),
    ],
)
def test_read_shape_says_why_it_declines(tmp_path, change, reason):
    config = {"architectures": ["LlamaForCausalLM"], **COMMON, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape, why = llama_config.read_shape(tmp_path / "config.json")
    assert shape is None and reason in why


def test_read_shape_takes_the_model_type_of_a_config_saved_alone(tmp_path):
    transformers.Qwen2Config(**COMMON).save_pretrained(tmp_path)  # no "architectures"
    shape, _ = llama_config.read_shape(tmp_path / "config.json")
    assert shape.architecture == "Qwen2ForCausalLM"
    transformers.GPT2Config().save_pretrained(tmp_path)
    assert "model_type 'gpt2'" in llama_config.read_shape(tmp_path / "config.json")[1]


def test_read_shape_defaults_and_the_qwen_fields(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], **COMMON, "num_key_value_heads": None})
    )
    shape, _ = llama_config.read_shape(path)
    assert (shape.num_key_value_heads, shape.head_dim, shape.rms_norm_eps) == (4, 16, 1e-6)
    assert not shape.tie_word_embeddings and shape.rope_theta == 10000.0
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], **COMMON, "num_key_value_heads": None}
    path.write_text(json.dumps(qwen2))
    assert "num_key_value_heads" in llama_config.read_shape(path)[1]  # its class default: 32
    path.write_text(json.dumps({**qwen2, "num_key_value_heads": 2, "use_sliding_window": True}))
    assert "sliding windows" in llama_config.read_shape(path)[1]
    path.write_text(json.dumps({**qwen2, "num_key_value_heads": 2}))
    assert llama_config.read_shape(path)[0].qkv_bias  # Qwen2's q, k and v always have biases


def test_checkpoints_that_do_not_fit_are_clear_errors(tmp_path):
    model_dir = save_variant(tmp_path, "llama")
    weights = load_file(model_dir / "model.safetensors")
    # Another .safetensors file beside the checkpoint (an adapter's) is not read.
    save_file({"base_model.lora_A.weight": torch.zeros(2)}, model_dir / "adapter_model.safetensors")
    assert load_model(str(model_dir), dtype="float32").num_layers == 2
    loaded = load_model(str(model_dir), dtype="float32")
    twice = list(weights.items()) + [("model.norm.weight", weights["model.norm.weight"])]
    with pytest.raises(ValueError, match="'model.norm.weight' is there twice"):
        llama_weights.copy_weights(loaded.model, twice)
    save_file(
        {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k},
        model_dir / "model.safetensors",
    )
    with pytest.raises(
        ModelLoadError,
        match=r"lack model\.layers\.1\.mlp\.gate_up_proj.*"
        r"model_impl='transformers' loads it",
    ):
        load_model(str(model_dir), dtype="float32")
    save_file(
        {**weights, "model.layers.0.self_attn.extra.weight": torch.zeros(2)},
        model_dir / "model.safetensors",
    )
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.extra.weight' has no"):
        load_model(str(model_dir), dtype="float32")
    save_file({**weights, "model.norm.weight": torch.ones(7)}, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(7,\)"):
        load_model(str(model_dir), dtype="float32")
    save_file(weights, model_dir / "model.safetensors")  # and the model loads again
    assert load_model(str(model_dir), dtype="float32").num_layers == 2


def test_dummy_weights_are_drawn_as_transformers_draws_them(tmp_path):
    model_dir = save_variant(tmp_path, "llama-biases-tied")
    (model_dir / "model.safetensors").unlink()  # dummy weights need the config alone
    torch.manual_seed(5)
    model = load_model(str(model_dir), dtype="float32", load_format="dummy").model
    torch.manual_seed(5)
    again = load_model(str(model_dir), dtype="float32", load_format="dummy").model
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )  # seeded
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(COMMON["hidden_size"]))
    bias = layer.self_attn.qkv_proj.bias
    assert torch.equal(bias, torch.zeros_like(bias))
    std = layer.mlp.gate_up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02


def test_a_worker_on_it_never_imports_transformers_modeling_code(tiny_model):
    """The point of it: a worker's start skips transformers' modeling imports, and the
    torch._dynamo, torch.distributed.tensor and sympy imports they bring."""
    script = (
        "import sys\n"
        "from loomllm.config import EngineConfig\n"
        "from loomllm.workers.worker.state import Worker\n"
        f"c = EngineConfig({tiny_model!r}, device='cpu', dtype='float32')\n"
        "w = Worker.start(c.model, c.worker_spec().options, 0, 1, '')\n"
        "print(type(w.loaded.model).__name__)\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo', 'sympy',\n"
        "             'torch.distributed.tensor') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[:2] == ["LlamaFamilyForCausalLM", "[]"]


def test_a_decode_step_launches_eight_kernels_a_layer(monkeypatch, tmp_path):
    """One layer of a decode-only step through the Triton backend, fused: the eleven of
    transformers' model with the fused kernels swapped in (test_fused_layers.py),
    less the residual add after the MLP, which the next norm's kernel computes, and the
    rotary embedding and the K/V write, which the decode attention's kernel does."""
    loaded = load_model(str(save_variant(tmp_path, "llama")), dtype="bfloat16")
    install_fused_ops(loaded.model)
    launches = decode_layer_launches(monkeypatch, loaded.model, loaded.config)
    assert sum(launches.values()) == 8, launches
    assert launches["linear"] == 4 and launches["_add_rms_norm_kernel"] == 2, launches
    assert launches["_decode_split_kernel"] == 1, launches
    assert not {"add", "_write_kv_kernel", "_rope_cache_kernel"} & set(launches), launches


def test_with_the_skinny_matmul_a_decode_step_launches_seven_kernels_a_layer(monkeypatch, tmp_path):
    """One stream's step where the worker's timing chose the skinny matmul for every
    weight: its four matmuls are Triton kernels, the gate|up one computes SiLU times up
    too, and the attention over 3 pages in 3 splits is one kernel, its last split merging."""
    loaded = load_model(str(save_variant(tmp_path, "llama")), dtype="bfloat16")
    install_fused_ops(loaded.model)
    for module in loaded.model.modules():
        if isinstance(module, llama_family.Linear):
            module.skinny = True
    splits = []
    split_kernel = ta._decode_split_kernel

    class Recorded:
        def __getitem__(self, grid):
            splits.append(grid[2])
            return split_kernel[grid]

    monkeypatch.setattr(ta, "_decode_split_kernel", Recorded())
    launches = decode_layer_launches(
        monkeypatch, loaded.model, loaded.config, requests=1, prompt_len=40
    )
    assert splits[-1] == 3, splits
    assert sum(launches.values()) == 7, launches
    assert launches["_skinny_kernel"] == 3 + 1 and "linear" not in launches, launches
    assert launches["_decode_split_kernel"] == 1, launches
    assert "_silu_mul_kernel" not in launches, launches


def test_a_new_requests_one_token_row_is_a_prompt_chunk(monkeypatch, tmp_path):
    """A request admitted with all but one token of its prompt in the prefix cache computes
    one token. The blocks it reads may be ones another row fills in that very step, so its
    row goes as a prompt chunk: the step is not decode-only, and the decode kernel (which
    writes a decode's K/V as it attends) does not run it. The next step is decode-only."""
    loaded = load_model(str(save_variant(tmp_path, "llama")), dtype="bfloat16")
    install_fused_ops(loaded.model)
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        block_size=16,
        num_blocks=16,
        attention_backend="triton",
    )
    scheduler = Scheduler(SchedulerConfig(4, 256, 64, 16, 16))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [5 + j % 50 for j in range(32)]
    scheduler.add_request(Request("a", prompt, params, frozenset(), 64, 0.0))
    rotated = []
    attend_rotating = attention.attend_rotating
    monkeypatch.setattr(
        attention,
        "attend_rotating",
        lambda *args: rotated.append(attend_rotating(*args)) or rotated[-1],
    )

    def step(call_id: int) -> dict[str, int]:
        rotated.clear()
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so, call_id))
        return so.num_scheduled_tokens

    assert step(0) == {"a": 32}
    scheduler.add_request(Request("b", [*prompt, 7], params, frozenset(), 64, 0.0))
    assert step(1) == {"a": 1, "b": 1}  # b's two full blocks are a's: one token left
    assert rotated == [None] * COMMON["num_hidden_layers"], rotated
    assert step(2) == {"a": 1, "b": 1}
    assert len(rotated) == COMMON["num_hidden_layers"] and None not in rotated
