"""A model's logits over a token list as a worker computes them (a prompt step, then a
decode step, over a paged KV cache), for tests that compare models."""

from __future__ import annotations

import torch

from loomllm.workers.attention import paged
from loomllm.workers.attention.metadata import (
    AttentionMetadata,
    PrefillRow,
    context_metadata,
    paged_metadata,
)

BLOCK = 16


def paged_logits(
    model: torch.nn.Module,
    shape: object,
    tokens: list[int],
    backend: str,
    cache_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`model` over `tokens` as a worker runs it: all but the last as one prompt, then the
    last as a decode step, over a paged KV cache. [T, V]. A transformers model is routed to
    loomllm's attention first, as the worker's runner routes it."""
    paged.route_transformers_model(model)
    num_blocks = -(-len(tokens) // BLOCK) + 1
    cache_shape = (num_blocks * BLOCK, shape.num_key_value_heads, shape.head_dim)
    caches = [
        (torch.zeros(cache_shape, dtype=cache_dtype), torch.zeros(cache_shape, dtype=cache_dtype))
        for _ in range(shape.num_hidden_layers)
    ]
    blocks = list(range(num_blocks - 1))
    n = len(tokens) - 1
    prompt_row = PrefillRow(0, n, torch.arange(n))

    def run(ids: list[int], start: int, meta: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            return model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(start, start + len(ids))[None],
                attn_metadata=meta,
            ).logits[0]

    if backend == "triton":
        prompt_meta = paged_metadata(
            caches,
            torch.device("cpu"),
            BLOCK,
            list(range(n)),
            [],
            [],
            [],
            [prompt_row],
            [blocks],
            [n],
        )
        decode_meta = paged_metadata(
            caches, torch.device("cpu"), BLOCK, [n], [0], [blocks], [n + 1], [], [], []
        )
    else:
        prompt_meta = context_metadata(
            caches, torch.device("cpu"), list(range(n)), [], [], [prompt_row]
        )
        decode_meta = context_metadata(
            caches, torch.device("cpu"), [n], [0], [list(range(n + 1))], []
        )
    return torch.cat([run(tokens[:n], 0, prompt_meta), run(tokens[n:], n, decode_meta)])
