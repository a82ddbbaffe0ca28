"""Ollama's /api/tags and details for a loaded model: its size and format are its weights'
file's (a GGUF runs from the file: the cache folder holds its config and tokenizer alone)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from loomllm.protocols.messages import ModelInfo
from loomllm.server.fleet.catalog import ModelEntry
from loomllm.server.ollama.model_card import details
from loomllm.server.ollama_routes import _listing


def loaded(model_dir: Path, weights_path: str) -> SimpleNamespace:
    info = ModelInfo(
        model="m",
        model_dir=str(model_dir),
        vocab_size=8,
        max_model_len=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        dtype="bfloat16",
        device="cpu",
        load_seconds=0.1,
        num_kv_blocks=4,
        block_size=16,
        weights_path=weights_path,
    )
    return SimpleNamespace(model_info=info, config=SimpleNamespace(quantization=None))


def test_a_gguf_is_listed_at_its_file_s_size_and_format(tmp_path):
    model_dir = tmp_path / "cache"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    gguf = tmp_path / "m.Q4_K_M.gguf"
    gguf.write_bytes(bytes(1234))
    engine = loaded(model_dir, str(gguf))
    listing = _listing(ModelEntry(name="m", model=str(gguf)), engine)
    assert listing["size"] == 1234
    assert listing["details"]["format"] == "gguf" and listing["details"]["family"] == "llama"


def test_a_folder_is_listed_at_its_safetensors_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "model.safetensors").write_bytes(bytes(99))
    engine = loaded(tmp_path, "")
    assert _listing(ModelEntry(name="m", model=str(tmp_path)), engine)["size"] == 99
    assert details(engine)["format"] == "safetensors"
