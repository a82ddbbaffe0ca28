"""A request's allowed token ids and logit bias as device tensors, applied to each step's
logits without a per-step Python loop; and the tokens its bad words ban at a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.device.transfer import device_tensor

F32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True, slots=True)
class TokenFilters:
    """One request's allowed ids and logit bias on the device, built once when the worker first
    sees it: some requests give a whole vocabulary's worth, too many to walk every step."""

    allowed: torch.Tensor | None  # [A] int64: the only ids it may sample; None: any
    bias_ids: torch.Tensor | None  # [K] int64
    bias_values: torch.Tensor | None  # [K] float32, within float32's range

    @classmethod
    def of(
        cls, params: SamplingParams, vocab_size: int, device: torch.device
    ) -> TokenFilters | None:
        """None when the request has neither. Ids beyond the logits are dropped: the
        engine refuses them, and one must never fail a step that others share."""
        if params.allowed_token_ids is None and not params.logit_bias:
            return None
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = device_tensor(
                [t for t in params.allowed_token_ids if t < vocab_size], torch.int64, device
            )
        bias_ids = bias_values = None
        if params.logit_bias:
            pairs = [
                (t, min(max(b, -F32_MAX), F32_MAX))
                for t, b in params.logit_bias.items()
                if t < vocab_size
            ]
            bias_ids = device_tensor([t for t, _ in pairs], torch.int64, device)
            bias_values = device_tensor([b for _, b in pairs], torch.float32, device)
        return cls(allowed, bias_ids, bias_values)


def _rows_and(
    filters: list[TokenFilters | None], name: str, device: torch.device
) -> tuple[torch.Tensor, list[int]] | None:
    """Each row's `name` tensor concatenated, with the row index of every entry; and the
    rows that have one. None when no row has one."""
    rows = [i for i, f in enumerate(filters) if f is not None and getattr(f, name) is not None]
    if not rows:
        return None
    sizes = [len(getattr(filters[i], name)) for i in rows]
    # Host values through pinned memory, the output size given: no wait on the device.
    row_index = torch.repeat_interleave(
        device_tensor(rows, torch.int64, device),
        device_tensor(sizes, torch.int64, device),
        output_size=sum(sizes),
    )
    return row_index, rows


def apply_allowed(x: torch.Tensor, filters: list[TokenFilters | None]) -> torch.Tensor:
    """Rows with allowed ids keep only those ids' logits; the others become -inf."""
    found = _rows_and(filters, "allowed", x.device)
    if found is None:
        return x
    row_index, rows = found
    ids = torch.cat([filters[i].allowed for i in rows])  # type: ignore[union-attr,misc]
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[row_index, ids] = True
    limited = device_tensor(
        [f is not None and f.allowed is not None for f in filters], torch.bool, x.device
    )[:, None]
    return x.masked_fill(limited & ~keep, float("-inf"))


def apply_bias(x: torch.Tensor, filters: list[TokenFilters | None]) -> torch.Tensor:
    """Each row's bias added to its logits, out of place. A sum float32 cannot hold stays
    finite (inf would be NaN after softmax); a banned -inf stays banned."""
    found = _rows_and(filters, "bias_ids", x.device)
    if found is None:
        return x
    row_index, rows = found
    ids = torch.cat([filters[i].bias_ids for i in rows])  # type: ignore[union-attr,misc]
    values = torch.cat([filters[i].bias_values for i in rows])  # type: ignore[union-attr,misc]
    old = x[row_index, ids]  # [K]
    new = torch.where(old.isfinite(), (old + values).clamp(-F32_MAX, F32_MAX), old)
    return x.index_put((row_index, ids), new)


def bad_word_bans(sequences: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The token each bad-word sequence would complete next: its last, wherever the output
    ends with the rest of it (vLLM's rule: the output only, not the prompt)."""
    bans = []
    for seq in sequences:
        rest = len(seq) - 1
        if rest == 0 or (rest <= len(output) and tuple(output[len(output) - rest :]) == seq[:-1]):
            bans.append(seq[-1])
    return bans
