"""Llama 4 on transformers' modeling code in loomllm's packed batches: its chunked attention
kept within one chunk, and its NoPE layers' query temperature taken at each token's position.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def context_limit(text_config: Any) -> int | None:
    """The longest context loomllm runs the model at, where chunked attention binds it.

    A chunked layer's query sees only the keys of its own chunk of attention_chunk_size
    positions. Within the first chunk that is causal attention, which every attention
    kernel computes; past it the kernels would be wrong, so the context stops there."""
    chunk = getattr(text_config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(text_config, "layer_types", None) or ()):
        return int(chunk)
    return None


def adapt(model: torch.nn.Module) -> None:
    """Give each NoPE layer's temperature tuning the real positions of the step's tokens.

    transformers scales those layers' queries by log1p(floor((pos + 1) / floor_scale)) *
    attn_scale + 1, with pos counted from its own KV cache, which a packed batch of requests
    at different positions does not have. The layer is told not to, and its q_proj's output
    is scaled instead, by the positions the decoder layer is called with; with no rotary
    embedding or norm on those layers, that is the same product."""
    for layer in model.modules():
        attn: Any = getattr(layer, "self_attn", None)  # transformers' attention, or None
        if type(attn).__name__ != "Llama4TextAttention" or attn.use_rope:
            continue
        if not attn.attn_temperature_tuning:
            continue
        temperature = _Temperature(attn.floor_scale, attn.attn_scale)
        layer.register_forward_pre_hook(temperature.record, with_kwargs=True)
        attn.q_proj.register_forward_hook(temperature.scale)
        attn.attn_temperature_tuning = False


class _Temperature:
    """One NoPE layer's query temperature, at the positions its decoder layer was called with."""

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        self.floor_scale = floor_scale
        self.attn_scale = attn_scale
        self.positions: torch.Tensor | None = None

    def record(self, layer: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.positions = kwargs.get("position_ids")
        if self.positions is None:
            raise RuntimeError("Llama 4's temperature tuning needs the tokens' position_ids")

    def scale(self, q_proj: torch.nn.Module, args: Any, query: torch.Tensor) -> torch.Tensor:
        assert self.positions is not None
        positions = self.positions.float()  # [1, T]
        scales = torch.log1p(torch.floor((positions + 1.0) / self.floor_scale))
        scales = scales * self.attn_scale + 1.0
        return (query * scales.unsqueeze(-1)).to(query.dtype)
