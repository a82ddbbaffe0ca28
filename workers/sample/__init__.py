"""Sampling on a worker: logits to token ids, token filters and structured outputs."""
