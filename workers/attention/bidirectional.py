"""An encoder's attention (BERT and its kin) behind transformers' interface: each request of
the packed step attends over all of its own tokens, both ways, with no KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from loomllm.workers.attention.metadata import AttentionMetadata

BIDIRECTIONAL_NAME = "loom_bidirectional"


def bidirectional_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each request's tokens, which a step holds whole (the engine never
    splits an encoder's prompt): [1, T, H, D]. The mask transformers would build for a padded
    batch is not needed: the packed batch has no padding."""
    if attn_metadata is None:
        raise RuntimeError("loom_bidirectional attention needs attn_metadata (via ModelRunner)")
    q, k, v = query[0], key[0], value[0]
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = torch.empty_like(q)  # [H, T, D]
    covered = 0
    for row in attn_metadata.prefills:
        rows = slice(row.token_start, row.token_start + row.num_tokens)
        out[:, rows] = F.scaled_dot_product_attention(
            q[:, rows], k[:, rows], v[:, rows], scale=scaling
        )
        covered += row.num_tokens
    if covered != q.shape[1]:
        raise RuntimeError(f"an encoder step holds {q.shape[1]} tokens, its requests {covered}")
    return out.transpose(0, 1).unsqueeze(0), None


def route_encoder(model: torch.nn.Module) -> None:
    """Make a transformers encoder call `bidirectional_attention`."""
    from transformers import AttentionInterface  # a big import, for HF models only

    AttentionInterface.register(BIDIRECTIONAL_NAME, bidirectional_attention)
    encoder: Any = model  # models/encoders.py's: nn.Module's type does not know its methods
    encoder.set_attn_implementation(BIDIRECTIONAL_NAME)
