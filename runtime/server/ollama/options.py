"""An Ollama request's `options` and `format` as SamplingParams: SamplingParams' own fields by
their names, Ollama's other names for them mapped, the options that only tune Ollama's runner
ignored, and any other refused by name rather than dropped."""

from __future__ import annotations

import json
from typing import Any

from loomllm.protocols.sampling import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    field_specs,
)
from loomllm.server.bodies.ollama_bodies import GeneratingBody
from loomllm.server.openai.api_error import ApiError, bad

# Ollama's options by SamplingParams' names: its own names (temperature, top_p, ...) and the
# two it names otherwise.
SAMPLING = {name: name for name, args in field_specs().items() if args[3].in_body} | {
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
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


def sampling_params(body: GeneratingBody, defaults: dict[str, Any], stream: bool) -> SamplingParams:
    """The request's SamplingParams over the model's defaults (generation_config, as the
    OpenAI routes take them); a 400 naming the option that cannot be honoured."""
    options = body.options or {}
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
    fields["structured_outputs"] = _format(body.format)
    fields["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"options: {exc}", "options") from None


def _format(value: str | dict[str, Any] | None) -> StructuredOutputsParams | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=json.dumps(value))
