"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added to and
removed from a running server (only with --allow-runtime-lora-updating, as in vLLM)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from loomllm.server.openai.api_error import ApiError, bad
from loomllm.server.request_body import read_body
from loomllm.server.state import server_state


async def load_lora_adapter(request: Request) -> Response:
    """Serve the body's `lora_path` as `lora_name` (on `base_model_name`, else the default)."""
    body, fleet = await read_body(request), server_state(request).fleet
    name, path = _name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad("lora_path must be a non-empty string", "lora_path")
    try:
        fleet.add_adapter(name, path, body.get("base_model_name"))
    except ValueError as exc:
        raise bad(str(exc), "lora_path" if "adapter_config" in str(exc) else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """Stop serving `lora_name`: a 404 naming it if the server has no such adapter."""
    body, fleet = await read_body(request), server_state(request).fleet
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
