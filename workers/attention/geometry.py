"""The shape of a model's KV cache, read from its config: layers, KV heads and head size."""

from __future__ import annotations


def kv_geometry(config: object, tp_size: int = 1) -> tuple[int, int, int]:
    """(layers, KV heads of one rank, head dim) of an HF decoder config (or its text
    config), its KV heads split over `tp_size` tensor-parallel ranks."""
    text = getattr(config, "text_config", None) or config
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, num_kv_heads // tp_size, head_dim
