"""A pooling runner's embeddings: each prompt's last hidden states pooled as its model says
(models/pooling.py), over however many chunks its prefill was split into.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loomllm.protocols.messages import PooledOutput, Pooling


@dataclass(slots=True)
class PoolRow:
    """One request's tokens in a step: where they sit in the packed batch, and whether they
    end its prompt."""

    state: Any  # the request's CachedRequestState (its `pooled` carries a partial pool)
    token_start: int  # packed index of its first token this step
    start: int  # prompt position of that token
    num_tokens: int
    completes: bool


def hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: Any,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's last hidden states (after its final norm) of one packed step: [T, H].
    `token_type_ids` [1, T]: an encoder's segments, where a request holds a pair of texts."""
    own = getattr(model, "last_hidden_states", None)
    if token_type_ids is not None:  # only an encoder's requests have them
        return own(input_ids, positions, meta, token_type_ids)[0]  # type: ignore[misc]
    if own is not None:  # loomllm's own model, or an encoder (models/encoders.py)
        return own(input_ids, positions, meta)[0]
    hf: Any = model  # a transformers model: nn.Module's type does not know its methods
    decoder = hf.get_decoder()  # transformers' base model, under its LM head
    out = decoder(input_ids=input_ids, position_ids=positions, use_cache=False, attn_metadata=meta)
    return out.last_hidden_state[0]


def pool(
    hidden: torch.Tensor,
    rows: list[PoolRow],
    pooling: Pooling,
    classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[PooledOutput]:
    """Fold this step's hidden states [T, H] into each row's pool; the embeddings of the
    rows whose prompt is complete (a classifier's: `classify` of its CLS hidden state)."""
    done = []
    for row in rows:
        h = hidden[row.token_start : row.token_start + row.num_tokens].float()
        state = row.state
        if pooling.method == "mean":
            part = h.sum(0)
            state.pooled = part if state.pooled is None else state.pooled + part
        elif pooling.method in ("cls", "classify") and row.start == 0:
            state.pooled = h[0]
        if not row.completes:
            continue
        if pooling.method == "last":
            vector = h[-1]
        elif pooling.method == "mean":
            vector = state.pooled / len(state.prompt_token_ids)
        elif pooling.method == "classify":
            assert classify is not None, "a classifier's model has a head (models/encoders.py)"
            vector = classify(state.pooled).float()
        else:
            vector = state.pooled
        if pooling.normalize:
            vector = F.normalize(vector, dim=0)
        done.append(PooledOutput(state.req_id, vector.cpu().numpy()))
    return done
