"""The model architectures loomllm runs, each checked against transformers by a parity test
(the encoders, which only embed, against sentence-transformers); any other is refused at load
with one error that names it and lists these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loomllm.workers.models.encoders import CLASSIFIERS, ENCODERS
from loomllm.workers.models.sources import ModelLoadError

# Architecture -> its model_type (a config.json saved alone names only that).
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",  # text in, its language model alone runs
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Llama4ForCausalLM": "llama4_text",
    "Llama4ForConditionalGeneration": "llama4",  # text in, its language model alone runs
}


class UnsupportedArchitectureError(ModelLoadError):
    """A model whose architecture loomllm does not run (right), refused before loading it."""


def architecture(config: dict[str, Any]) -> str:
    """The architecture a config.json names: its `architectures`, else its model_type's."""
    named = config.get("architectures") or []
    if len(named) == 1:
        return str(named[0])
    if named:
        raise UnsupportedArchitectureError(f"config.json names several architectures: {named}")
    by_type = {model_type: arch for arch, model_type in {**ENCODERS, **SUPPORTED}.items()}
    model_type = config.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise UnsupportedArchitectureError(
        f"config.json names no architecture, and its model_type {model_type!r} is not one "
        f"loomllm runs; supported: {', '.join(SUPPORTED)}"
    )


def check(config_path: Path) -> str:
    """The architecture of the model whose config.json is `config_path`, if loomllm runs it;
    else UnsupportedArchitectureError naming it and listing the supported ones."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    arch = architecture(config)
    if arch in SUPPORTED or arch in ENCODERS or arch in CLASSIFIERS:
        return arch
    raise UnsupportedArchitectureError(
        f"architecture {arch} is not supported; loomllm runs {', '.join(SUPPORTED)}; to "
        f"embed (runner='pooling') {', '.join(ENCODERS)}; and to classify and score "
        f"(runner='pooling') {', '.join(CLASSIFIERS)}"
    )
