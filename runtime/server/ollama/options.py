"""An Ollama request's `options` and `format` as SamplingParams: each option loomllm honours
mapped to vLLM's name, the ones that only tune Ollama's runner ignored, and any other
refused by name rather than dropped."""

from __future__ import annotations

import json
from typing import Any

from loomllm.protocols.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams
from loomllm.server.openai.api_error import ApiError, bad

# Ollama's option -> SamplingParams' field.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# How Ollama's runner loads and runs a model: the engine decides those, for every request.
RUNNER_ONLY = {
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "use_mmap",
    "use_mlock",
    "low_vram",
    "numa",
    "num_keep",
    "repeat_last_n",
    "penalize_newline",
}
# Options that change sampling, accepted at the value that changes nothing.
NEUTRAL = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0}


def sampling_params(body: dict[str, Any], defaults: dict[str, Any], stream: bool) -> SamplingParams:
    """The request's SamplingParams over the model's defaults (generation_config, as the
    OpenAI routes take them); a 400 naming the option that cannot be honoured."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad("options must be an object", "options")
    fields: dict[str, Any] = dict(defaults)
    for name, value in options.items():
        if name in SAMPLING:
            fields[SAMPLING[name]] = value
        elif name == "num_predict":
            # -1: until a stop; -2: until the context is full. Both: no max_tokens.
            fields["max_tokens"] = None if value in (-1, -2) else value
        elif name in NEUTRAL:
            if value != NEUTRAL[name]:
                raise bad(f"options.{name} is not supported (only {NEUTRAL[name]})", "options")
        elif name not in RUNNER_ONLY:
            raise bad(f"options.{name} is not an option loomllm knows", "options")
    if "stop" in fields and isinstance(fields["stop"], str):
        fields["stop"] = [fields["stop"]]
    fields["structured_outputs"] = _format(body.get("format"))
    fields["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"options: {exc}", "options") from None


def _format(value: Any) -> StructuredOutputsParams | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(value, dict):
        return StructuredOutputsParams(json=json.dumps(value))
    raise bad('format must be "json" or a JSON schema', "format")
