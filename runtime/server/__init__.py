"""OpenAI-compatible HTTP server over an Engine: build_app() and serve() on hypercorn."""

from runtime.server.app import build_app
from runtime.server.run import serve

__all__ = ["build_app", "serve"]
