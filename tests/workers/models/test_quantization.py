"""Quantization on load and GGUF weights as stored: which loads may run it, the kernels each
layer gets, that every kernel a layer may pick computes with the same (quantized) weights,
and that a8 (activations in int8 too) stays close to them."""

from __future__ import annotations

import pytest
import torch
from support.models import make_tiny_model

from loomllm import Engine, SamplingParams, WorkerStartError
from loomllm.workers.kernels import cpu_kernel_choice, cpu_native
from loomllm.workers.models import quantization
from loomllm.workers.models.llama.model import Linear
from loomllm.workers.models.loader import load_model
from loomllm.workers.models.sources import cache_root

pytestmark = pytest.mark.compute
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def cpu_ops():
    """The C++ ops (a8's kernel) from the shared build, before tests point LOOM_CACHE_DIR at
    their own dirs for the kernel measurements: a process loads one build, once."""
    assert cpu_native.load(cache_root()) is not None, "the C++ ops did not build"


@pytest.mark.parametrize(
    ("asked", "source", "device", "own", "runs"),
    [
        (None, "gguf", CPU, True, "gguf"),
        (None, "gguf", CUDA, True, "none"),
        (None, "gguf", CPU, False, "none"),
        (None, "dir", CPU, True, "none"),
        ("none", "gguf", CPU, True, "none"),
        ("int4", "dir", CPU, True, "int4"),
        ("int8", "dir", CPU, True, "int8"),
    ],
)
def test_what_a_load_runs(asked, source, device, own, runs):
    assert quantization.resolve(asked, source, device, own) == runs


@pytest.mark.parametrize(
    ("asked", "source", "device", "own", "says"),
    [
        ("gptq", "dir", CPU, True, "quantization must be one of"),
        ("int4", "dir", CUDA, True, "runs on the CPU only"),
        ("int8", "dir", CPU, False, "needs loomllm's own"),
        ("gguf", "dir", CPU, True, "is for GGUF files"),
        ("int4", "gguf", CPU, True, "quantized already"),
    ],
)
def test_what_a_load_refuses(asked, source, device, own, says):
    with pytest.raises(ValueError, match=says):
        quantization.resolve(asked, source, device, own)


def test_16_bit_weights_and_random_weights_take_no_gguf_blocks():
    assert quantization.resolve(None, "gguf", CPU, True, weight_dtype="bfloat16") == "none"
    assert quantization.resolve(None, "gguf", CPU, True, dummy=True) == "none"
    assert quantization.resolve("int4", "dir", CPU, True, dummy=True) == "int4"
    with pytest.raises(ValueError, match="and weight_dtype='bfloat16' do not go together"):
        quantization.resolve("int8", "dir", CPU, True, weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="load_format='dummy' draws random ones"):
        quantization.resolve("gguf", "gguf", CPU, True, dummy=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-quantized"), seed=4)


def logits_of(model_dir: str, **options) -> torch.Tensor:
    model = load_model(model_dir, dtype="float32", **options).model
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 42, 9, 3, 77]])).logits


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_each_kernel_computes_with_the_quantized_weights(kind, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    model = load_model(tiny, dtype="float32", quantization=kind, cpu_linear_kernel=kind).model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(layer.kernels is not None for layer in layers)
    assert all(getattr(layer.kernels, kind) is not None for layer in layers)
    quantized = logits_of(tiny, quantization=kind, cpu_linear_kernel=kind)
    dense = logits_of(tiny, quantization=kind, cpu_linear_kernel="dense")
    original = logits_of(tiny, quantization="none")
    assert torch.allclose(quantized, dense, rtol=1e-4, atol=1e-4)
    assert (dense - original).abs().max() > 1e-4  # the weights were quantized
    assert not list(tmp_path.rglob("*.json"))  # one kernel forced: nothing measured


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a8_runs_the_quantized_weights_on_int8_activations(kind, tiny, tmp_path, monkeypatch):
    """Each layer's blocks are the quantized weights; the activations' rounding to 8 bits
    (per 32) moves the logits a little, never a lot."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    model = load_model(tiny, dtype="float32", quantization=kind, cpu_linear_kernel="a8").model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(layer.kernels.a8 is not None for layer in layers)
    for layer in layers:
        x = torch.randn(3, layer.in_features)
        exact = x.double() @ layer.weight.double().T  # the dense copy: the blocks' values
        error = (layer(x).double() - exact).abs().max()
        assert 0 < error < 0.02 * exact.abs().max()
    a8 = logits_of(tiny, quantization=kind, cpu_linear_kernel="a8")
    dense = logits_of(tiny, quantization=kind, cpu_linear_kernel="dense")
    assert 0 < (a8 - dense).abs().max() < 0.05 * dense.abs().max()


class WithoutVnni:
    """The C++ ops as on a CPU without AVX512-VNNI."""

    def __init__(self, ops):
        self.ops = ops

    def block_linear_has_vnni(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self.ops, name)


def test_without_vnni_a8_runs_only_where_asked_for(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    slow = WithoutVnni(cpu_native.loaded())
    monkeypatch.setattr(quantization.cpu_native, "load", lambda cache_dir: slow)
    offered = []
    monkeypatch.setattr(
        cpu_kernel_choice,
        "measure",
        lambda shape, kinds, dtype: offered.append(kinds) or ("dense",) * 4,
    )
    load_model(tiny, dtype="float32", quantization="int4")
    assert offered and all("a8" not in kinds for kinds in offered)
    model = load_model(tiny, dtype="float32", quantization="int4", cpu_linear_kernel="a8").model
    assert model.model.layers[0].mlp.down_proj.kernels.a8 is not None


def test_smollm2_runs_its_own_blocks():
    """SmolLM2's Q4_1 layers and Q8_0 embedding (its lm_head) as the file stores them (on
    AVX512-VNNI repacked for the a8 kernel, in the same bytes), and the next token is the
    dequantized model's."""
    from loomllm.workers.kernels import cpu_native
    from loomllm.workers.kernels.gguf_linear import GgufLinear, RepackedLinear

    stored = load_model("smollm2", dtype="float32").model
    reference = load_model("smollm2", dtype="float32", quantization="none").model
    repacked = cpu_native.loaded().block_linear_has_vnni()
    kind = RepackedLinear if repacked else GgufLinear
    assert isinstance(stored.lm_head, kind) and stored.lm_head.types == [8]  # Q8_0
    assert stored.model.layers[0].mlp.down_proj.types == [3]  # Q4_1
    for name in ("lm_head", "model.layers.3.self_attn.qkv_proj"):
        layer, dense = stored.get_submodule(name), reference.get_submodule(name)
        assert isinstance(layer, kind)
        x = torch.randn(1, layer.in_features)
        exact = x.double() @ dense.weight.double().T
        assert (layer(x).double() - exact).abs().max() < 0.02 * exact.abs().max()
    ids = torch.tensor([[1, 504, 3458, 314, 4224, 282, 4649, 314]])
    with torch.no_grad():
        ours, theirs = stored(ids).logits[0, -1], reference(ids).logits[0, -1]
    assert ours.argmax() == theirs.argmax()
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()


def test_the_measured_choice_is_what_each_layer_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    measured = ("int4", "int4", "dense", "dense")
    monkeypatch.setattr(cpu_kernel_choice, "measure", lambda shape, kinds, dtype: measured)
    model = load_model(tiny, dtype="float32", quantization="int4").model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.kernels.choice == measured and layer.kernels.int8 is None
    calls = []
    int4 = layer.kernels.int4
    layer.kernels.int4 = lambda x: calls.append(x.shape) or int4(x)
    layer(torch.randn(1, 1, 64))
    layer(torch.randn(1, 32, 64))  # a bigger step: the dense matmul
    assert calls == [(1, 1, 64)]
    assert (tmp_path / "cpu_kernels").is_dir()


@pytest.mark.anyio
async def test_a_quantization_the_model_cannot_take_fails_alone(tiny, shared_manager):
    with pytest.raises(WorkerStartError, match="quantization='gguf' is for GGUF files"):
        async with Engine(tiny, manager_socket=shared_manager.socket, quantization="gguf"):
            pass
    async with Engine(tiny, manager_socket=shared_manager.socket, dtype="float32") as engine:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        outputs = [out async for out in engine.generate("w5 w6", params)]
        assert len(outputs[-1].outputs[0].token_ids) == 3


def test_a_tied_lm_head_is_quantized_alone(tiny, tmp_path, monkeypatch):
    """Quantizing a tied lm_head gives it weights of its own: the embedding keeps its values."""
    import json
    import shutil

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    tied = tmp_path / "tied"
    shutil.copytree(tiny, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    plain = load_model(str(tied), dtype="float32", quantization="none").model
    model = load_model(
        str(tied), dtype="float32", quantization="int8", cpu_linear_kernel="int8"
    ).model
    embedding = model.model.embed_tokens.weight
    assert torch.equal(embedding, plain.model.embed_tokens.weight)
    assert model.lm_head.weight is not embedding
    assert not torch.equal(model.lm_head.weight, embedding)
    assert model.lm_head.kernels is not None


def test_kernels_and_dense_fallback_agree_in_bfloat16(tiny, tmp_path, monkeypatch):
    """Each step's kernel depends on its rows: in bfloat16 too, every kernel must compute
    with the same weights (the dense copy holds the kernel's rounded scales)."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    ids = torch.tensor([[5, 17, 42, 9, 3, 77]])
    outputs = []
    for kernel in ("int4", "dense"):
        model = load_model(tiny, dtype="bfloat16", quantization="int4", cpu_linear_kernel=kernel)
        with torch.no_grad():
            outputs.append(model.model(ids).logits.float())
    assert (outputs[0] - outputs[1]).abs().max() < 0.05 * outputs[1].abs().max()
