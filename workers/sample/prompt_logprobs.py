"""Prompt logprobs (vLLM's prompt_logprobs): each prompt token's logprob, rank and top-k
under the logits of the position before it, computed in slices of rows."""

from __future__ import annotations

from typing import Any

import torch

from loomllm.protocols.messages import PromptLogprobs

_PROMPT_ROWS = 1024  # rows of float32 log_softmax at a time: bounds memory for long prompts


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score the next prompt token at each row of `logits` [N, V] (any float dtype).

    Returns, on the CPU: each target's raw logprob [N] float32, its rank [N] int64 (vLLM's:
    1 + the number of other tokens at least as likely), and the top-k ids [N, k] int64 and
    logprobs [N, k] float32, descending. `target_ids` [N] is on the logits' device.
    """
    lps, ranks, top_ids, top_lps = [], [], [], []
    k = min(k, logits.shape[-1])
    for start in range(0, logits.shape[0], _PROMPT_ROWS):
        rows = logits[start : start + _PROMPT_ROWS].float().log_softmax(dim=-1)  # [n, V]
        target = rows.gather(1, target_ids[start : start + _PROMPT_ROWS, None])  # [n, 1]
        lps.append(target[:, 0])
        ranks.append((rows >= target).sum(dim=-1))  # [n]
        values, ids = rows.topk(k, dim=-1)  # [n, k]
        top_lps.append(values)
        top_ids.append(ids)
    lp, rank, ids, values = (torch.cat(t).cpu() for t in (lps, ranks, top_ids, top_lps))
    return lp, rank, ids, values


def score_prompt_chunks(
    logits: torch.Tensor, scored: list[tuple[Any, int, int]]
) -> list[PromptLogprobs]:
    """Each scored request's chunk: the logprob, rank and top-k of its next prompt tokens.

    `scored`: (request state, first position, count) in the row order of `logits`."""
    chunks = []
    row = 0
    for state, start, num in scored:
        targets = state.prompt_token_ids[start + 1 : start + 1 + num]
        lps, ranks, top_ids, top_lps = compute_prompt_logprobs(
            logits[row : row + num],  # [num, V]
            torch.tensor(targets, dtype=torch.long, device=logits.device),
            state.sampling_params.prompt_logprobs or 0,
        )
        chunks.append(
            PromptLogprobs(
                state.req_id,
                start + 1,
                lps.numpy(),
                ranks.numpy(),
                top_ids.numpy(),
                top_lps.numpy(),
            )
        )
        row += num
    return chunks
