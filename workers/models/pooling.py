"""How a pooling model (runner="pooling") turns a prompt into one embedding: read from its
sentence-transformers files where it has them, else vLLM's default for a decoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loomllm.protocols.messages import Pooling
from loomllm.workers.models.sources import ModelLoadError

# sentence-transformers' pooling modes loomllm computes -> its own names. Its Pooling config
# names one by `pooling_mode` (version 6), or sets one `pooling_mode_<flag>` (before).
_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_FLAGS = {"lasttoken": "lasttoken", "mean_tokens": "mean", "cls_token": "cls"}
# The sentence-transformers modules a pooling model may be made of, by class name.
_MODULES = ("Transformer", "Pooling", "Normalize")


def read_pooling(model_dir: Path, text_config: Any, encoder: bool = False) -> Pooling:
    """The model's pooling. From modules.json and its Pooling module's config.json where the
    model has them (sentence-transformers' layout): one of last token, mean or CLS, and
    whether a Normalize module follows; a module loomllm does not compute (Dense, ...) is
    refused by name. Without them, vLLM's defaults: the last token's hidden state for a
    decoder, the first (CLS) for an `encoder`, normalized."""
    size = int(text_config.hidden_size)
    # config.json's own words: loomllm's model config keeps only what it computes.
    config = _read_json(Path(model_dir) / "config.json")
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return Pooling("cls" if encoder else "last", True, size, matryoshka, not encoder)
    modules = _read_json(modules_file)
    try:
        kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{modules_file} is not a list of modules: {exc}") from exc
    other = [m["type"] for m, kind in zip(modules, kinds, strict=True) if kind not in _MODULES]
    if other:
        raise ModelLoadError(
            f"{modules_file} holds {', '.join(other)}: loomllm pools with a Transformer, a "
            "Pooling and a Normalize module only"
        )
    if kinds.count("Pooling") != 1:
        raise ModelLoadError(f"{modules_file} needs one Pooling module, it has {kinds}")
    pooling_file = Path(model_dir) / modules[kinds.index("Pooling")].get("path", "") / "config.json"
    pooling = _read_json(pooling_file)
    asked = pooling.get("pooling_mode")
    if asked is None:  # sentence-transformers before 6: one flag each
        prefix = "pooling_mode_"
        asked = [
            flag[len(prefix) :] for flag, on in pooling.items() if flag.startswith(prefix) and on
        ]
        asked = [_FLAGS.get(flag, flag) for flag in asked]
    modes = [asked] if isinstance(asked, str) else list(asked)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ModelLoadError(
            f"{pooling_file} asks for {modes or 'no pooling'}: loomllm pools by exactly one "
            f"of {', '.join(_MODES)}"
        )
    if pooling.get("include_prompt") is False:
        raise ModelLoadError(f"{pooling_file} leaves the prompt out of the pool: not supported")
    return Pooling(_MODES[modes[0]], "Normalize" in kinds, size, matryoshka, not encoder)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


# sentence-transformers' CrossEncoder activations loomllm applies to a score, by class name.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "none"}


def read_classifier(model_dir: Path, config: Any) -> Pooling:
    """A classifier's pooling: its head's logits over the CLS token, one per label. The
    activation that turns a pair's logit into its score is sentence-transformers' CrossEncoder
    one where the model names it, else CrossEncoder's default (sigmoid for one label)."""
    num_labels = int(config.num_labels)
    named = _read_json(Path(model_dir) / "config.json").get("sentence_transformers") or {}
    st_config = Path(model_dir) / "config_sentence_transformers.json"
    if st_config.is_file():  # sentence-transformers 5 and later
        named = _read_json(st_config)
    activation = named.get("activation_fn") or named.get("sbert_ce_default_activation_function")
    if activation is None:
        score_activation = "sigmoid" if num_labels == 1 else "none"
    else:
        score_activation = _ACTIVATIONS.get(str(activation).rsplit(".", 1)[-1], "")
        if not score_activation:
            raise ModelLoadError(
                f"{model_dir} scores with {activation}: loomllm applies "
                f"{' or '.join(_ACTIVATIONS)} only"
            )
    id2label = getattr(config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
    return Pooling(
        "classify",
        False,
        num_labels,
        False,
        False,
        score_activation=score_activation,
        labels=labels,
    )
