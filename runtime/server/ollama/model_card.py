"""What Ollama's /api/show and /api/tags say of the served model, read from its files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loomllm.engine.engine import Engine


def _config(engine: Engine) -> dict[str, Any]:
    try:
        config = json.loads((Path(engine.model_info.model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config") or config


def details(engine: Engine) -> dict[str, Any]:
    """Ollama's `details`: format, family, quantization."""
    family = str(_config(engine).get("model_type") or "")
    return {
        "parent_model": "",
        "format": "gguf" if engine.model_info.weights_path.endswith(".gguf") else "safetensors",
        "family": family,
        "families": [family] if family else [],
        "parameter_size": "",
        "quantization_level": engine.config.quantization or engine.model_info.dtype,
    }


def show(engine: Engine) -> dict[str, Any]:
    """Ollama's /api/show: details, the chat template, model_info and capabilities."""
    config = _config(engine)
    family = str(config.get("model_type") or "")
    tokenizer = engine.tokenizer
    template = ""
    if tokenizer is not None and tokenizer.chat_templates:
        template = next(iter(tokenizer.chat_templates.values()))
    info: dict[str, Any] = {"general.architecture": family}
    for key, name in (
        ("context_length", None),
        ("embedding_length", "hidden_size"),
        ("block_count", "num_hidden_layers"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
    ):
        value = engine.max_model_len if name is None else config.get(name)
        if value is not None:
            info[f"{family}.{key}"] = value
    pooling = engine.model_info.pooling is not None
    return {
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": details(engine),
        "model_info": info,
        "capabilities": ["embedding"] if pooling else ["completion"],
    }
