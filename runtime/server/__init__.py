"""OpenAI-compatible HTTP server over an Engine: build_app() and serve() on hypercorn."""

from loomllm.server.app import build_app
from loomllm.server.run import serve

__all__ = ["build_app", "serve"]
