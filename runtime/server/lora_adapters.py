"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added to and
removed from a running server (only with --allow-runtime-lora-updating, as in vLLM)."""

from __future__ import annotations

from typing import Any

from starlette.responses import PlainTextResponse, Response

from loomllm.server.fleet.fleet import ModelFleet
from loomllm.server.openai.api_error import ApiError, bad


def load_adapter(fleet: ModelFleet, body: dict[str, Any]) -> Response:
    """Serve the body's `lora_path` as `lora_name` (on `base_model_name`, else the default)."""
    name, path = _name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad("lora_path must be a non-empty string", "lora_path")
    try:
        fleet.add_adapter(name, path, body.get("base_model_name"))
    except ValueError as exc:
        raise bad(str(exc), "lora_path" if "adapter_config" in str(exc) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def unload_adapter(fleet: ModelFleet, body: dict[str, Any]) -> Response:
    """Stop serving `lora_name`: a 404 naming it if the server has no such adapter."""
    name = _name(body)
    try:
        fleet.remove_adapter(name)
    except KeyError:
        raise ApiError(
            404, f"the LoRA adapter {name!r} does not exist", "lora_name", "NotFoundError"
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad("lora_name must be a non-empty string", "lora_name")
    return name
