"""GGUF's 4-bit blocks read as groupwise int4: equal to gguf's own dequantization for Q4_0,
Q4_1 and Q4_K, and, on SmolLM2's file, to transformers' conversion tensor by tensor (names,
and llama's q and k rows in the checkpoint's order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from loomllm.workers.models import gguf_weights, sources


def assert_same_weights(groups, raw: np.ndarray, kind: GGMLQuantizationType) -> None:
    want = torch.from_numpy(dequantize(raw, kind).astype(np.float32))
    got = groups.dequantize()
    # Our form, (q - 8) * scale + zero, rounds differently from ggml's d * q + m: one ulp.
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_blocks(kind):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((12, 256)).astype(np.float32)
    raw = quantize(values, GGMLQuantizationType[kind])
    groups = gguf_weights._int4_groups(kind, raw)
    assert groups is not None and groups.codes.shape == (12, 256)
    assert_same_weights(groups, raw, GGMLQuantizationType[kind])


def test_q4_k_blocks():
    """Random super-blocks (gguf cannot quantize Q4_K): every scale and min bit pattern."""
    rng = np.random.default_rng(1)
    rows, blocks = 8, 3
    raw = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.1, size=(rows, blocks, 2)).astype(np.float16)
    raw[..., 0:4] = halves.view(np.uint8).reshape(rows, blocks, 4)
    raw = raw.reshape(rows, blocks * 144)
    groups = gguf_weights._int4_groups("Q4_K", raw)
    assert groups is not None and groups.codes.shape == (rows, blocks * 256)
    assert_same_weights(groups, raw, GGMLQuantizationType.Q4_K)


def test_other_types_are_not_int4():
    assert gguf_weights._int4_groups("Q8_0", np.zeros((2, 34), np.uint8)) is None


def test_rows_are_unpermuted_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["llama"]()
    rows = np.arange(4 * 2 * 8)[:, None]  # 4 heads of 16 rows
    want = processor._reverse_permute_weights(rows, 4, 4)[:, 0]
    assert gguf_weights._unpermute_rows(64, 4).tolist() == want.tolist()


@pytest.mark.slow
def test_smollm2_stored_weights_equal_the_converted_checkpoint(monkeypatch):
    from safetensors import safe_open

    monkeypatch.setenv("LOOM_CACHE_DIR", str(sources.cache_root()))
    source = sources.resolve_model("smollm2")
    converted = sources.prepare_model_dir(source)
    architecture, stored = gguf_weights.read_stored_weights(Path(source.path), 9, 3)
    assert architecture == "llama"
    assert stored["model.embed_tokens.weight"].gguf_type == "Q8_0"
    int4 = {name: w.int4() for name, w in stored.items() if w.is_int4}
    assert len(int4) == 30 * 7  # every projection of every layer
    with safe_open(str(converted / "model.safetensors"), "pt") as checkpoint:
        for name, groups in int4.items():
            want = checkpoint.get_tensor(name)
            assert torch.allclose(groups.dequantize(), want, rtol=0, atol=1e-6), name


def test_the_header_index_agrees_with_gguf_s_reader():
    from gguf import GGUFReader

    path = Path(sources.resolve_model("smollm2").path)
    architecture, stored = gguf_weights.read_stored_weights(path, 9, 3)
    reader = GGUFReader(str(path))
    assert architecture == "llama"
    by_name = {t.name: t for t in reader.tensors}
    assert len(stored) == 30 * 7 + 1  # the layers' projections and the embedding
    for gguf_name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        tensor = by_name[gguf_name]
        name = gguf_weights._checkpoint_name(gguf_name)
        assert stored[name].gguf_type == tensor.tensor_type.name
        raw = np.asarray(tensor.data).reshape(stored[name].raw.shape)
        assert np.array_equal(stored[name].raw, raw), name


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (b"GGML" + bytes(20), "is not a GGUF file"),
        (b"GGUF" + bytes([0, 0, 0, 3]) + bytes(16), "version"),
    ],
)
def test_a_file_that_is_no_gguf_we_read_is_refused(head, says, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(head)
    with pytest.raises(ValueError, match=says):
        gguf_weights.read_stored_weights(path, 4, 2)
