"""One step's attention metadata, from the model runner's packed batch to device tensors.

The torch backend reads padded context slots, the Triton backend block tables (paged.py: both).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loomllm.workers.device.transfer import device_tensor, to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
PREFILL_TILE = 16  # queries per program of the Triton prefill kernel (tl.dot's minimum rows)


@dataclass(slots=True)
class PrefillRow:
    """A request computing several tokens this step (prompt or chunk of it)."""

    token_start: int  # first of its tokens in the packed batch
    num_tokens: int
    context_slots: torch.Tensor  # [seq_len] cache slot of every token of its context


@dataclass(slots=True)
class PrefillBatch:
    """The torch backend's prefill rows as the C++ CPU kernel takes them, in one call a layer:
    each row's context slots (padded to the longest), context length (this step's tokens
    included), and its tokens' first index and count in the packed batch."""

    slots: torch.Tensor  # [P, max context] long
    lens: torch.Tensor  # [P] long
    q_starts: torch.Tensor  # [P] long
    q_lens: torch.Tensor  # [P] long


@dataclass(slots=True)
class PagedBatch:
    """The Triton backend's view of a step: block tables and lengths, int32 on the device.

    Decode rows are the requests computing one token, in decode_token_idx order; prefill
    rows the others, with where their queries start in the packed batch."""

    block_size: int
    decode_tables: torch.Tensor  # [Bd, max_blocks]
    decode_lens: torch.Tensor  # [Bd] context length, this step's token included
    max_decode_len: int
    prefill_tables: torch.Tensor  # [P, max_blocks]
    prefill_q_starts: torch.Tensor  # [P]
    prefill_q_lens: torch.Tensor  # [P]
    prefill_lens: torch.Tensor  # [P]
    prefill_tile_reqs: torch.Tensor  # [N]: the prefill row of each query tile (-1: none)
    prefill_tile_firsts: torch.Tensor  # [N]: the tile's first query within its row
    # [>= Bd * KVH] int32 zeros: the decode kernel's split counters. Every layer's launch
    # leaves them zero again, so all layers share them (triton_kernels.decode_attention).
    decode_split_counts: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once per step by the model runner."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_slots, KVH, D]
    slot_mapping: torch.Tensor  # [T] where each packed token's K/V is written
    # Requests computing exactly one token, batched: their token index in the packed batch,
    # their context slots padded to the longest, and which padded entries are real.
    decode_token_idx: torch.Tensor  # [Bd]
    decode_slots: torch.Tensor  # [Bd, L]
    decode_valid: torch.Tensor  # [Bd, L] bool
    decode_lens: torch.Tensor  # [Bd] long: how many of a row's decode_slots are real
    # The same as an additive mask (0 or -inf) in the cache's dtype, built once per step:
    # SDPA's CPU kernel takes a float mask ~1.5x faster than a bool one.
    decode_bias: torch.Tensor  # [Bd, 1, 1, L]
    prefills: list[PrefillRow]
    # The same rows batched, on the torch backend (None without prompt rows, and on the Triton
    # backend).
    prefill_batch: PrefillBatch | None = None
    # When set, the Triton kernels attend and decode_slots, decode_valid, decode_lens and
    # decode_bias are empty.
    paged: PagedBatch | None = None


def prefill_tiles(q_lens: list[int], num_tiles: int | None = None) -> tuple[list[int], list[int]]:
    """(request, first query) of each PREFILL_TILE-query tile of requests computing
    `q_lens` tokens, padded with (-1, 0) to `num_tiles`."""
    reqs = [r for r, n in enumerate(q_lens) for _ in range(0, n, PREFILL_TILE)]
    firsts = [first for n in q_lens for first in range(0, n, PREFILL_TILE)]
    pad = (len(reqs) if num_tiles is None else num_tiles) - len(reqs)
    if pad < 0:
        raise ValueError(f"{len(reqs)} tiles do not fit in {num_tiles}")
    return reqs + [-1] * pad, firsts + [0] * pad


def max_tiles(num_tokens: int, num_requests: int) -> int:
    """The most tiles that `num_tokens` queries of `num_requests` requests can take."""
    return num_tokens // PREFILL_TILE + num_requests


def context_metadata(
    kv_caches: KVCaches,
    device: torch.device,
    slots: list[int],
    decode_idx: list[int],
    decode_ctx: Sequence[Sequence[int]],
    prefills: list[PrefillRow],
) -> AttentionMetadata:
    """The torch backend's: each decode's context slots (lists, or arrays of int64, which
    are copied as memory), padded, with a mask and a bias."""
    lens = [len(c) for c in decode_ctx]
    longest = max(lens, default=0)
    # One buffer of every row's slots, padded, read as one tensor: a tensor a row took
    # ~1.5 ms a step at 64 rows of 200 slots.
    flat = array("q")
    for context, length in zip(decode_ctx, lens, strict=True):
        flat.extend(context)
        flat.extend(itertools.repeat(0, longest - length))
    padded = (
        torch.frombuffer(flat, dtype=torch.long).view(len(lens), longest)
        if flat
        else torch.zeros((len(lens), longest), dtype=torch.long)
    )
    valid = to_device(torch.arange(longest) < torch.tensor(lens, dtype=torch.long)[:, None], device)
    bias = torch.zeros(valid.shape, dtype=kv_caches[0][0].dtype, device=device)
    bias.masked_fill_(~valid, float("-inf"))
    return AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=device_tensor(slots, torch.long, device),
        decode_token_idx=device_tensor(decode_idx, torch.long, device),
        decode_slots=to_device(padded, device),
        decode_valid=valid,
        decode_lens=device_tensor(lens, torch.long, device),
        decode_bias=bias[:, None, None, :],
        prefills=prefills,
        prefill_batch=prefill_batch(prefills) if prefills else None,
    )


def prefill_batch(prefills: list[PrefillRow]) -> PrefillBatch:
    """`prefills` (at least one) as one PrefillBatch, on the CPU (where the kernel that reads
    it runs)."""
    contexts = [row.context_slots for row in prefills]
    return PrefillBatch(
        slots=torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True),
        lens=torch.tensor([c.numel() for c in contexts], dtype=torch.long),
        q_starts=torch.tensor([row.token_start for row in prefills], dtype=torch.long),
        q_lens=torch.tensor([row.num_tokens for row in prefills], dtype=torch.long),
    )


def paged_metadata(
    kv_caches: KVCaches,
    device: torch.device,
    block_size: int,
    slots: list[int],
    decode_idx: list[int],
    decode_blocks: list[list[int]],
    decode_lens: list[int],
    prefills: list[PrefillRow],
    prefill_blocks: list[list[int]],
    prefill_lens: list[int],
) -> AttentionMetadata:
    """The Triton backend's: block tables and context lengths (this step's tokens
    included), no per-slot context."""

    def tables(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        return to_device(torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width), device)

    def ints(values: list[int]) -> torch.Tensor:
        return device_tensor(values, torch.int32, device)

    tile_reqs, tile_firsts = prefill_tiles([p.num_tokens for p in prefills])
    paged = PagedBatch(
        block_size=block_size,
        decode_tables=tables(decode_blocks),
        decode_lens=ints(decode_lens),
        max_decode_len=max(decode_lens, default=0),
        prefill_tables=tables(prefill_blocks),
        prefill_q_starts=ints([p.token_start for p in prefills]),
        prefill_q_lens=ints([p.num_tokens for p in prefills]),
        prefill_lens=ints(prefill_lens),
        prefill_tile_reqs=ints(tile_reqs),
        prefill_tile_firsts=ints(tile_firsts),
        decode_split_counts=split_counters(kv_caches, len(decode_lens), device),
    )
    none = torch.empty((0, 0), dtype=torch.long, device=device)
    return AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=device_tensor(slots, torch.long, device),
        decode_token_idx=device_tensor(decode_idx, torch.long, device),
        decode_slots=none,
        decode_valid=none.bool(),
        decode_lens=none.view(0),
        decode_bias=none,
        prefills=prefills,
        paged=paged,
    )


def split_counters(kv_caches: KVCaches, decode_rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed split counters for `decode_rows` decode rows (PagedBatch.decode_split_counts):
    one per row and KV head of a layer."""
    kv_heads = kv_caches[0][0].shape[1] if kv_caches and decode_rows else 0
    return torch.zeros(decode_rows * kv_heads, dtype=torch.int32, device=device)
