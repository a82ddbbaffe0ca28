"""Ollama's API (/api/*) on the same server as the OpenAI one."""
