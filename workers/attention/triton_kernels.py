"""Paged attention in Triton for CUDA: prefill over the packed batch, split-K decode, KV writes.

On the CPU they run under TRITON_INTERPRET=1 for tests only, as torch is faster there.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from loomllm.workers.attention.metadata import (
    PREFILL_TILE as BLOCK_M,  # queries per prefill program
)
from loomllm.workers.kernels.fused_ops import dot_f32, rotated

# The kernels read K/V through block tables from the slot-major cache that paged.py writes,
# [num_blocks * block_size, KVH, D]: slot = block * block_size + offset.
MIN_DOT_ROWS = 16  # tl.dot's minimum rows on GPUs
TARGET_PROGRAMS = 264  # decode splits aim at ~2 programs per SM of an H100 (132 SMs)
MAX_SPLITS = 32


@dataclasses.dataclass(frozen=True)
class AttentionTiling:
    """How an attention kernel walks a context: `keys` a step (a power of two >= 16, over
    as many pages as they span), with `warps` warps and `stages` loads in flight."""

    keys: int
    warps: int
    stages: int

    def __post_init__(self) -> None:
        if self.keys < MIN_DOT_ROWS or self.keys & (self.keys - 1):
            raise ValueError(f"keys must be a power of two >= {MIN_DOT_ROWS}, got {self.keys}")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1:
            raise ValueError(f"warps must be 1-16, a power of two, and stages >= 1: {self}")

    @classmethod
    def parse(cls, text: str) -> AttentionTiling:
        """ "64x4x3": keys x warps x stages."""
        keys, warps, stages = (int(part) for part in text.split("x"))
        return cls(keys, warps, stages)

    def __str__(self) -> str:
        return f"{self.keys}x{self.warps}x{self.stages}"


def _tiling_from_env(variable: str, default: str) -> AttentionTiling:
    text = os.environ.get(variable) or default
    try:
        return AttentionTiling.parse(text)
    except ValueError as exc:
        raise ValueError(f"{variable}={text!r} is not keys x warps x stages: {exc}") from None


# Chosen on an H200 by `loom bench kernel decode-attention` (the decode kernel's, among the others
# it times) and by workload (a)'s prompt steps (the prefill kernel's). LOOM_DECODE_TILING and
# LOOM_PREFILL_TILING ("64x4x3") set others, for the workers started after they are set.
DECODE_TILING = _tiling_from_env("LOOM_DECODE_TILING", "64x4x3")
PREFILL_TILING = _tiling_from_env("LOOM_PREFILL_TILING", "64x4x3")


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    q_starts_ptr,
    q_lens_ptr,
    seq_lens_ptr,
    tile_reqs_ptr,
    tile_firsts_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEYS: tl.constexpr,
    EXACT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One program per (tile of BLOCK_M queries of one request, query head), causal over the
    request's whole context. A tile of request -1 does nothing: a CUDA graph's grid is fixed, so
    its tile list is padded. Mixed-step graphs run even one-token rows through this kernel."""
    req = tl.load(tile_reqs_ptr + tl.program_id(0))
    head = tl.program_id(1)
    if req >= 0:
        first = tl.load(tile_firsts_ptr + tl.program_id(0))  # the tile's first query
        q_len = tl.load(q_lens_ptr + req)
        q_start = tl.load(q_starts_ptr + req)
        seq_len = tl.load(seq_lens_ptr + req)
        kv_head = head // GROUP
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_pos = seq_len - q_len + rows  # each query's absolute position
        q = tl.load(
            q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        # Keys from the first one the tile's first query sees to its last query's position.
        last_key = tl.minimum(seq_len - q_len + first + BLOCK_M, seq_len) - 1
        first_key = tl.where(window > 0, tl.maximum(seq_len - q_len + first - window + 1, 0), 0)
        # KEYS keys a step over as many pages as they span, as the decode kernel walks them.
        offs = tl.arange(0, KEYS)
        for start in range(first_key, last_key + 1, KEYS):
            k_pos = start + offs
            key_in = k_pos <= last_key
            block = tl.load(
                block_tables_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=key_in, other=0
            )
            slots = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
            kv_ok = key_in[:, None] & d_ok[None, :]
            k = tl.load(
                k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=kv_ok,
                other=0.0,
            )
            s = _capped(dot_f32(q, tl.trans(k), EXACT) * scale, softcap, SOFTCAP)
            seen = (k_pos[None, :] <= q_pos[:, None]) & key_in[None, :]
            seen &= (k_pos[None, :] > q_pos[:, None] - window) | (window <= 0)
            s = tl.where(seen, s, float("-inf"))
            m, s_sum, acc = _online_softmax_step(
                s,
                m,
                s_sum,
                acc,
                v_cache_ptr,
                slots,
                kv_ok,
                kv_head,
                stride_ks,
                stride_kh,
                d,
                EXACT,
            )
        # A sink (gpt-oss) is one more logit in each softmax's sum, attending to no value.
        s_sum += _sink_weight(sinks_ptr, head, m, SINKS)
        out = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]
        out_rows = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh
        tl.store(
            out_rows + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _capped(s, softcap, SOFTCAP: tl.constexpr):
    """Gemma 2's logit softcap, softcap * tanh(s / softcap), as transformers computes it
    (tanh through exp: the interpreter and every GPU have it)."""
    if SOFTCAP:
        x = s / softcap
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
    return s


@triton.jit
def _sink_weight(sinks_ptr, heads, m, SINKS: tl.constexpr):
    """exp(sink - m) of each row's head: the sink's share of a softmax whose running max is
    m (0 without sinks)."""
    if SINKS:
        sink = tl.load(sinks_ptr + heads).to(tl.float32)
        return tl.exp(sink - m)
    return tl.zeros_like(m)


@triton.jit
def _online_softmax_step(
    s,
    m,
    s_sum,
    acc,
    v_cache_ptr,
    slots,
    kv_ok,
    kv_head,
    stride_ks,
    stride_kh,
    d,
    EXACT: tl.constexpr,
):
    """Fold one page's scores `s` [rows, keys] (masked keys at -inf) into the running max
    `m`, sum `s_sum` and weighted values `acc`."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    v = tl.load(
        v_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=kv_ok,
        other=0.0,
    )
    acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, EXACT)
    return m_new, s_sum * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    split_counts_ptr,
    out_ptr,
    k_new_ptr,
    v_new_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cb,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    EXACT: tl.constexpr,
    ROTARY: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One program per (request, KV head, split of the context), the KV head's `group` query
    heads together so that each K/V page is read once per KV head. Each split keeps an online
    softmax; the last split to finish merges them, so a layer needs one launch, not a second
    kernel for the merge.

    ROTARY: q and the new k come unrotated; the program rotates q as it loads it, and
    the one whose split holds the last position writes the rotated k and v into their
    slot before reading the cache (what fused_ops.rotary_into_cache does, bit for bit)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + req * stride_qb + heads[:, None] * stride_qh
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    if ROTARY:
        cos_row, sin_row = cos_ptr + req * stride_cb, sin_ptr + req * stride_cb
        q = rotated(q_rows, d, q_mask, cos_row, sin_row, HEAD_DIM).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # This request's own pages, spread over the splits: however long the batch's longest
    # context (a decode graph sizes for the longest the cache holds), each request keeps
    # every split busy, and its partition depends on its length and the split count only.
    start_page = first_key // BLOCK_SIZE
    last_page = tl.cdiv(seq_len, BLOCK_SIZE)
    pages_per_split = tl.cdiv(last_page - start_page, tl.num_programs(2))
    first_page = start_page + split * pages_per_split
    end_page = tl.minimum(first_page + pages_per_split, last_page)
    if ROTARY:
        if first_page < last_page and last_page <= end_page:  # its pages hold the new token
            slot = tl.load(slots_ptr + req).to(tl.int64) * stride_ks + kv_head * stride_kh
            k_new = rotated(
                k_new_ptr + req * stride_knb + kv_head * stride_knh,
                d,
                d_ok[None, :],
                cos_row,
                sin_row,
                HEAD_DIM,
            )
            tl.store(
                k_cache_ptr + slot + d[None, :],
                k_new.to(k_cache_ptr.dtype.element_ty),
                mask=d_ok[None, :],
            )
            v_new = tl.load(v_new_ptr + req * stride_vnb + kv_head * stride_vnh + d, mask=d_ok)
            tl.store(v_cache_ptr + slot + d, v_new, mask=d_ok)
        tl.debug_barrier()  # every thread's stores land before any thread loads that page
    # KEYS keys a step, over as many pages as they span: each step has more loads in
    # flight than one page's, which a long context's decode needs to reach the memory's
    # bandwidth. Each key finds its page in the block table (the same few words, cached).
    offs = tl.arange(0, KEYS)
    end_key = tl.minimum(end_page * BLOCK_SIZE, seq_len)
    for start in range(first_page * BLOCK_SIZE, end_key, KEYS):
        k_pos = start + offs
        in_split = k_pos < end_key
        block = tl.load(
            block_tables_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=in_split, other=0
        )
        slots = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        key_ok = in_split & (k_pos >= first_key)
        kv_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=kv_ok,
            other=0.0,
        )
        s = _capped(dot_f32(q, tl.trans(k), EXACT) * scale, softcap, SOFTCAP)  # [G, KEYS]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m, s_sum, acc = _online_softmax_step(
            s, m, s_sum, acc, v_cache_ptr, slots, kv_ok, kv_head, stride_ks, stride_kh, d, EXACT
        )
    g_ok = g < GROUP
    num_splits = tl.num_programs(2)
    if num_splits == 1:
        # The whole context in this program: the output itself, no partials to merge (a
        # branch on the grid, not a constexpr: one compiled kernel for every split count).
        s_sum += _sink_weight(sinks_ptr, tl.where(g_ok, heads, 0), m, SINKS)
        tl.store(
            out_ptr + req * stride_ob + heads[:, None] * stride_oh + d[None, :],
            (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partials laid out [B, H, splits] (+ [D]): contiguous, made by decode_attention.
        num_heads = tl.num_programs(1) * GROUP
        row = (req * num_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + row, m, mask=g_ok)
        tl.store(part_sum_ptr + row, s_sum, mask=g_ok)
        tl.store(
            part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
            acc,
            mask=g_ok[:, None] & d_ok[None, :],
        )
        # Count this split done; the last one merges. The barrier puts every thread's
        # stores before the count (one thread adds it), the add's release publishes them
        # to the GPU, and the last adder's acquire makes them visible to its loads.
        tl.debug_barrier()
        count = split_counts_ptr + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(count, 0)  # the next launch, a graph's replay too, needs it zero
            for i in range(GROUP):
                head = kv_head * GROUP + i
                out = _merge_splits(
                    part_acc_ptr,
                    part_max_ptr,
                    part_sum_ptr,
                    (req * num_heads + head) * num_splits,
                    num_splits,
                    d,
                    d_ok,
                    sinks_ptr,
                    head,
                    HEAD_DIM,
                    SPLITS_PAD,
                    SINKS,
                )
                tl.store(
                    out_ptr + req * stride_ob + head * stride_oh + d,
                    out.to(out_ptr.dtype.element_ty),
                    mask=d_ok,
                )


@triton.jit
def _merge_splits(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    first_row,
    num_splits,
    d,
    d_ok,
    sinks_ptr,
    head,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One head's output from its splits' partials (rows first_row.. of the partials),
    weighing each by exp(its max - the largest), the head's sink in the sum once: [D_PAD]
    float32. Read past the L1 cache (.cg): other programs wrote them."""
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    row = first_row + splits
    m = tl.load(part_max_ptr + row, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
    s_sum = tl.load(part_sum_ptr + row, mask=split_ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=split_ok[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    m_all = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # empty splits weigh 0
    total = tl.sum(s_sum * weight, 0) + _sink_weight(sinks_ptr, head, m_all, SINKS)
    return tl.sum(acc * weight[:, None], 0) / total


def prefill_attention(
    q: torch.Tensor,  # [T, H, D], the packed batch's queries
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [P, max_blocks] int32, one row per prefill request
    q_starts: torch.Tensor,  # [P] int32: first row of each request's queries in q
    q_lens: torch.Tensor,  # [P] int32
    seq_lens: torch.Tensor,  # [P] int32: context length, this step's tokens included
    tile_reqs: torch.Tensor,  # [N] int32, from prefill_tiles: the request of each tile
    tile_firsts: torch.Tensor,  # [N] int32: the tile's first query within its request
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    tiling: AttentionTiling = PREFILL_TILING,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each prefill request's queries over its paged context; rows of
    `out` (default: a new [T, H, D]) outside the requests are left as they are. `tiling`:
    keys a step, warps and stages; `softcap` and `sinks` [H]: as paged.py's torch backend
    computes them (Gemma 2, gpt-oss)."""
    _check(q, k_cache, v_cache, block_size)
    _check_sinks(sinks, q)
    out = torch.empty_like(q) if out is None else out
    num_heads, head_dim = q.shape[1], q.shape[2]
    _prefill_kernel[(tile_reqs.shape[0], num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        q_starts,
        q_lens,
        seq_lens,
        tile_reqs,
        tile_firsts,
        q if sinks is None else sinks,
        scale,
        sliding_window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=_d_pad(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        KEYS=tiling.keys,
        EXACT=_exact(q),
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=tiling.warps,
        num_stages=tiling.stages,
    )
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    num_heads,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """One program per token: its K and V heads into its cache slot."""
    t = tl.program_id(0).to(tl.int64)  # int64: t * stride passes 2**31 in long prompts
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_heads) & (d < HEAD_DIM)
    dest = slot * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dest, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dest, v, mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, KVH, D], any strides
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]: each token's slot
) -> None:
    """`k_cache[slot_mapping] = key` and the same for V, in one kernel (two index_copy_
    otherwise): K and V of one dtype, the caches'."""
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"write_kv copies without casting: K {key.dtype}, V {value.dtype}, "
            f"caches {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("write_kv needs caches laid out alike, a slot's heads dense")
    # The kernel needs a head's elements side by side, as projections leave them; a copy if not.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"K {tuple(key.shape)} and V {tuple(value.shape)} do not fit caches "
            f"of {tuple(k_cache.shape[1:])} a slot"
        )
    num_heads, head_dim = key.shape[1], key.shape[2]
    _write_kv_kernel[(key.shape[0],)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        num_heads,
        HEADS=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
    )


def decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, this step's token included
    max_seq_len: int,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    split_counts: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, ...] | None = None,
    tiling: AttentionTiling = DECODE_TILING,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each request's one query over its paged context, split-K: [B, H, D]. `split_counts`:
    int32 zeros, at least B * KV heads of them, that the kernel leaves zero (a step's
    layers, and a CUDA graph's replays, share one; default: new zeros, a launch more).
    `new_kv`: (k, v [B, KVH, D], cos, sin [B, D], slots [B]): q and k unrotated, the step's
    K/V not in the cache yet; the kernel rotates q and k and writes k and v into their
    slots, as fused_ops.rotary_into_cache would (the caller checks
    `rotary_into_cache_fits` first). `tiling`: keys a step, warps and stages; `softcap`
    and `sinks` [H]: as prefill_attention's."""
    _check(q, k_cache, v_cache, block_size)
    _check_sinks(sinks, q)
    k_new, v_new, cos, sin, slots = new_kv if new_kv is not None else (q, q, q, q, q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if new_kv is not None and not (
        k_new.shape == v_new.shape == (batch, num_kv_heads, head_dim)
        and cos.shape == sin.shape == (batch, head_dim)
        and slots.shape == (batch,)
    ):
        raise ValueError("new_kv: k, v [B, KVH, D], cos, sin [B, D] and slots [B] of q's B")
    group = num_heads // num_kv_heads
    pages = triton.cdiv(max_seq_len, block_size)
    if num_splits is None:  # enough programs to fill the GPU, at least a page each
        num_splits = triton.cdiv(TARGET_PROGRAMS, batch * num_kv_heads)
    # The split count is the grid's: one compiled kernel whatever the batch and lengths.
    num_splits = max(1, min(num_splits, MAX_SPLITS, pages))
    if split_counts is None:
        split_counts = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    elif split_counts.dtype != torch.int32 or split_counts.numel() < batch * num_kv_heads:
        raise ValueError(
            f"split_counts needs {batch * num_kv_heads} int32 zeros, got "
            f"{split_counts.numel()} of {split_counts.dtype}"
        )
    part_acc = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty_like(q)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_acc,
        part_max,
        part_sum,
        split_counts,
        out,
        k_new,
        v_new,
        cos,
        sin,
        slots,
        q if sinks is None else sinks,
        scale,
        sliding_window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        GROUP=group,
        GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=_d_pad(head_dim),
        BLOCK_SIZE=block_size,
        KEYS=tiling.keys,
        SPLITS_PAD=MAX_SPLITS,
        EXACT=_exact(q),
        ROTARY=new_kv is not None,
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=tiling.warps,
        num_stages=tiling.stages,
    )
    return out


def _d_pad(head_dim: int) -> int:
    return max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))  # tl.dot's minimum on GPUs


def _exact(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or bool(triton.knobs.runtime.interpret)


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be one contiguous logit per query head, [{q.shape[1]}]")


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches need a contiguous last dimension, K and V alike")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k_cache.shape[1]} KV heads")
    if block_size < MIN_DOT_ROWS or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= {MIN_DOT_ROWS}, got {block_size}")
