"""The model's own sampling defaults (its generation_config.json), which vLLM's
`--generation-config auto` applies to the requests that leave a field out."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from loomllm.protocols.sampling import SamplingParams

logger = logging.getLogger(__name__)

# generation_config's name -> SamplingParams' (vLLM reads the same keys).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(choice: str, model_dir: str) -> dict[str, Any]:
    """The defaults `choice` names: "auto", the model directory's generation_config.json;
    "vllm", none (SamplingParams' own); else a directory holding a generation_config.json.
    Values SamplingParams would refuse are logged and left out, all of them."""
    if choice == "vllm":
        return {}
    path = Path(model_dir if choice == "auto" else choice) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        logger.warning("%s unreadable, no sampling defaults from it: %s", path, exc)
        return {}
    if not isinstance(config, dict):
        return {}
    defaults = {
        ours: config[key] for key, ours in SAMPLING_KEYS.items() if config.get(key) is not None
    }
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        logger.warning("%s: sampling defaults left out: %s", path, exc)
        return {}
    if defaults:
        logger.info(
            "sampling defaults from %s: %s (--generation-config vllm: none)", path, defaults
        )
    return defaults
