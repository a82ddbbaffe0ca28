"""How a pooling model (runner="pooling") turns a prompt into one embedding: read from its
sentence-transformers files where it has them, else vLLM's default for a decoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loomllm.protocols.messages import Pooling
from loomllm.workers.models.sources import ModelLoadError

# sentence-transformers' Pooling config flag -> our method.
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
# The sentence-transformers modules a pooling model may be made of.
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_TRANSFORMER = "sentence_transformers.models.Transformer"


def read_pooling(model_dir: Path, text_config: Any) -> Pooling:
    """The model's pooling. From modules.json and its Pooling module's config.json where the
    model has them (sentence-transformers' layout): one of last token, mean or CLS, and
    whether a Normalize module follows; a module loomllm does not compute (Dense, ...) is
    refused by name. Without them: the last token's hidden state, normalized (vLLM's
    default for decoders)."""
    size = int(text_config.hidden_size)
    try:  # config.json's own words: loomllm's model config keeps only what it computes
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {model_dir}/config.json: {exc}") from exc
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return Pooling("last", True, size, matryoshka)
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [m["type"] for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {modules_file}: {exc}") from exc
    other = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if other:
        raise ModelLoadError(
            f"{modules_file} holds {', '.join(other)}: loomllm pools with a Transformer, a "
            "Pooling and a Normalize module only"
        )
    if kinds.count(_POOLING) != 1:
        raise ModelLoadError(f"{modules_file} needs one Pooling module, it has {kinds}")
    pooling_dir = Path(model_dir) / modules[kinds.index(_POOLING)].get("path", "")
    try:
        pooling_config = json.loads((pooling_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the Pooling module's config: {exc}") from exc
    modes = [method for flag, method in _MODES.items() if pooling_config.get(flag)]
    others = [
        flag
        for flag, value in pooling_config.items()
        if flag.startswith("pooling_mode_") and value and flag not in _MODES
    ]
    if len(modes) != 1 or others:
        raise ModelLoadError(
            f"{pooling_dir / 'config.json'} asks for {modes + others or 'no pooling'}: "
            f"loomllm pools by exactly one of {', '.join(_MODES)}"
        )
    return Pooling(modes[0], _NORMALIZE in kinds, size, matryoshka)
