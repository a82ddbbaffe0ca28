"""ServerState: the models and settings every route handler reads, from `app.state.server`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from loomllm.server.fleet.fleet import ModelFleet


@dataclass(frozen=True, slots=True)
class ServerState:
    fleet: ModelFleet
    max_body_bytes: int  # a larger body gets 413
    health_timeout: float  # seconds /health waits for each engine's probe
    # A chat body's chat_template may be a template's text, not only one of the model's names.
    trust_request_chat_template: bool
    tool_call_parser: str | None  # tool_choice "auto" reads calls out of answers; None: a 400
    reasoning_parser: str | None  # chat answers' reasoning split out of their text
    created: int  # the /v1/models cards' creation time
    openapi: dict[str, Any]  # /openapi.json


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
