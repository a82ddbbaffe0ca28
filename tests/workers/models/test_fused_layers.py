"""models/fused_layers.py: Llama-family models with the fused kernels and packed projections
compute transformers' logits (bit for bit in bf16), keep one copy of their weights, hand
what they do not handle to transformers' forward, and sample through a model runner what
one without them samples. The kernels run in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import copy
import gc
import inspect
import weakref

import pytest
import torch
import transformers
from support.kernel_count import decode_layer_launches
from support.runner_driver import drive
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from loomllm.core.request import Request
from loomllm.core.scheduler import Scheduler, SchedulerConfig
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.kernels import fused_ops
from loomllm.workers.models import fused_layers
from loomllm.workers.models.fused_layers import FusedModel, install_fused_ops
from loomllm.workers.runner.model_runner import ModelRunner

pytestmark = pytest.mark.compute

ARCHS = {
    "llama": (transformers.LlamaConfig, modeling_llama),
    "qwen2": (transformers.Qwen2Config, modeling_qwen2),
    "mistral": (transformers.MistralConfig, modeling_mistral),
}
IDS = torch.tensor([[5, 9, 2, 40, 7, 7, 13, 3, 61], [8, 1, 33, 4, 90, 12, 0, 0, 0]])


@pytest.fixture(autouse=True)
def restore_rotary(monkeypatch):
    """The rotary swap is global to a modeling module: undone after each test."""
    for _, modeling in ARCHS.values():
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)


def tiny(arch: str, **overrides) -> torch.nn.Module:
    config = ARCHS[arch][0](
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **overrides,
    )
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def count_calls(monkeypatch, module, name: str) -> list:
    calls: list = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or original(*a))
    return calls


VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama with biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
}
MASK = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])  # the second prompt padded on the right


def prompt_and_step(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of two prompts (one padded) without a transformers cache, then with one, then
    of one more token each from that cache."""
    # transformers 5.24 renamed `past_key_values` `cache`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        plain = model(IDS, attention_mask=MASK, use_cache=False).logits
        prompt = model(IDS, attention_mask=MASK)
        cache = getattr(prompt, name)
        assert cache.get_seq_length() == IDS.shape[1]
        step = model(
            torch.tensor([[17], [23]]),
            attention_mask=torch.cat([MASK, MASK[:, :1]], 1),
            **{name: cache},
        ).logits
    return [plain, prompt.logits, step]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_model_keeps_transformers_logits(monkeypatch, variant, dtype):
    arch, overrides = VARIANTS[variant]
    model = tiny(arch, **overrides).to(dtype)
    expected = prompt_and_step(model)
    assert install_fused_ops(model) == FusedModel(norms=2 * 2 + 1, rotary_modules=1, layers=2)
    # Idempotent: nothing left to swap (the rotary function is counted, not swapped again).
    assert install_fused_ops(model) == FusedModel(0, 1, 0)
    calls = {
        name: count_calls(monkeypatch, module, name)
        for module, name in [
            (fused_layers, "silu_mul"),
            (fused_layers, "add_rms_norm"),
            (fused_ops, "rotary"),
            (fused_layers, "_attention_function"),
        ]
    }
    got = prompt_and_step(model)
    # Three forwards of two layers; the packed attention in the first only, the two with a
    # transformers cache handed to transformers' own.
    assert {name: len(c) for name, c in calls.items()} == {
        "silu_mul": 6,
        "add_rms_norm": 6,
        "rotary": 6,
        "_attention_function": 2,
    }
    for out, ref in zip(got, expected, strict=True):
        if dtype == torch.bfloat16:  # every kernel rounds where torch's ops round
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_projections_are_packed_not_copied():
    model = tiny("qwen2")  # q, k and v with biases
    stock = copy.deepcopy(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    unpacked = [weakref.ref(m.weight) for m in (attn.q_proj, attn.k_proj, mlp.up_proj)]
    unpacked.append(weakref.ref(attn.v_proj.bias))
    install_fused_ops(model)
    gc.collect()
    assert all(ref() is None for ref in unpacked)  # let go: one copy of the weights
    assert attn.loom_qkv.sizes == (64, 32, 32) and mlp.loom_gate_up.sizes == (96, 96)
    packed = {
        p.untyped_storage().data_ptr()
        for p in (attn.loom_qkv.weight, attn.loom_qkv.bias, mlp.loom_gate_up.weight)
    }
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert m.weight.untyped_storage().data_ptr() in packed  # a view, not a copy
    stock_attn, stock_mlp = stock.model.layers[0].self_attn, stock.model.layers[0].mlp
    assert torch.equal(attn.v_proj.weight, stock_attn.v_proj.weight)
    assert torch.equal(attn.k_proj.bias, stock_attn.k_proj.bias)
    assert torch.equal(mlp.up_proj.weight, stock_mlp.up_proj.weight)


def test_models_the_kernels_cannot_run_keep_their_ops(monkeypatch):
    assert install_fused_ops(tiny("llama").half()) == FusedModel(0, 0, 0)
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors, and no interpreter to run them
    model = tiny("llama")
    assert install_fused_ops(model) == FusedModel(0, 0, 0)
    assert not hasattr(model.model.layers[0], "loom_fused")
    # Not the Llama family's layer: its parts are left alone.
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2)
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert install_fused_ops(gpt2) == FusedModel(0, 0, 0)


def drive_runner(model: torch.nn.Module, fused: bool) -> dict[str, list]:
    """Four requests, launched ahead: prompts longer than the windows below, chunked beside
    decodes. Fused: through a Triton-backend runner with decode and mixed-step graphs'
    padded paths (capture needs CUDA). Else the reference: transformers' ops over the
    torch backend, eager (nothing in the interpreter)."""
    backend = "triton" if fused else "torch"
    runner = ModelRunner(
        model,
        model.config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        num_blocks=24,
        attention_backend=backend,
    )
    if fused:
        assert install_fused_ops(model).layers == 2
        runner.enable_graphs(max_num_seqs=8, max_model_len=64, capture=False, max_step_tokens=64)
    scheduler = Scheduler(SchedulerConfig(8, 12, 64, 16, runner.num_blocks))
    for i in range(4):
        prompt = [5 + 3 * i + j for j in range(2 + 4 * i)]
        params = SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True, logprobs=2)
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset({2}), 64, 0.0))
    return {
        r: [(o.new_token_ids, o.new_logprobs) for o in outs]
        for r, outs in drive(scheduler, runner, ahead=True).items()
    }


WINDOWED = {
    "mistral": {"sliding_window": 5},  # every layer, from the config
    "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
}


@pytest.mark.parametrize("arch", WINDOWED)
def test_runner_samples_the_same_with_fused_layers(arch):
    """Through the paged attention, with a window that reaches it as the stock layer passes
    it: Mistral's on every layer, Qwen2's on its second (dropping either from the fused
    forward changes the tokens: mutation-checked)."""
    reference = drive_runner(tiny(arch, **WINDOWED[arch]), fused=False)
    fused = drive_runner(tiny(arch, **WINDOWED[arch]), fused=True)
    tokens = {r: [t for t, _ in steps] for r, steps in reference.items()}
    assert {r: [t for t, _ in steps] for r, steps in fused.items()} == tokens
    for r in reference:
        for (_, lp_ref), (_, lp_fused) in zip(reference[r], fused[r], strict=True):
            assert lp_fused == pytest.approx(lp_ref, rel=1e-4, abs=1e-5)


def test_a_decode_step_launches_eleven_kernels_a_layer(monkeypatch):
    """The count the README gives: one Llama layer of a decode-only step through the
    Triton backend, with transformers' ops and fused (its attention one kernel, however
    many splits: the last split merges them)."""
    counts = {}
    for fused in (False, True):
        model = tiny("llama").bfloat16()
        if fused:
            install_fused_ops(model)
        counts[fused] = decode_layer_launches(monkeypatch, model, model.config)
    assert sum(counts[True].values()) == 11, counts[True]
    assert counts[True]["_decode_split_kernel"] == 1, counts[True]
    assert counts[True]["linear"] == 4  # q|k|v, o, gate|up, down
    assert sum(counts[False].values()) > 3 * 12, counts[False]  # transformers' ops: 40 here
