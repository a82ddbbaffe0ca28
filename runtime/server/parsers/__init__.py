"""Readers of a model's own text: tool calls and reasoning, whole or streamed."""
