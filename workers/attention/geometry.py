"""The shape of a model's KV cache, read from its config: layers, KV heads and head size."""

from __future__ import annotations

from typing import Any


def kv_geometry(config: object, tp_size: int = 1) -> tuple[int, int, int]:
    """(layers, KV heads of one rank, head dim) of an HF decoder config (or its text
    config), its KV heads split over `tp_size` tensor-parallel ranks.

    Multi-head latent attention (DeepSeek-V2/V3) reaches the attention as one K and V per
    query head, K of qk_nope + qk_rope dims and V of v_head_dim: the cache holds both at the
    larger size, the smaller zero-padded (attention/paged.py)."""
    # A transformers config: its fields are set from the checkpoint's JSON, untyped.
    text: Any = getattr(config, "text_config", None) or config
    if is_latent_attention(text):
        heads = text.num_attention_heads
        head_dim = max(text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim)
        return text.num_hidden_layers, heads // tp_size, head_dim
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, num_kv_heads // tp_size, head_dim


def is_latent_attention(text_config: object) -> bool:
    """Whether the model's attention is multi-head latent attention (K and V sizes differ)."""
    return getattr(text_config, "kv_lora_rank", None) is not None
