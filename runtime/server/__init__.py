"""OpenAI-compatible HTTP server over an Engine: build_app() and serve() on hypercorn.

Both load on first use, so importing one part of the server loads only what that part needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loomllm.server.app import build_app
    from loomllm.server.run import serve

_MODULES = {"build_app": "loomllm.server.app", "serve": "loomllm.server.run"}

__all__ = ["build_app", "serve"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'loomllm.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
