"""Paged attention for the worker's models: the torch backend, also behind transformers' interface.

The model calls it per layer on the packed batch; on the Triton backend it runs triton_kernels.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from loomllm.workers.attention.metadata import AttentionMetadata, PagedBatch, PrefillRow
from loomllm.workers.kernels import cpu_native

ATTENTION_NAME = "loom_paged"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    attn_metadata: AttentionMetadata | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One layer's attention over the packed `[1, T]` batch (Q and K with RoPE applied): writes
    the step's K/V into the paged cache, then attends each request over its own context, in
    torch or, when the metadata carries block tables (`paged`), with the Triton kernels.
    `softcap` (Gemma 2: scores become softcap * tanh(scores / softcap)) and `s_aux` (gpt-oss:
    a sink logit per query head, in each softmax's sum but attending to no value) are
    computed by both backends."""
    if attn_metadata is None:
        raise RuntimeError("loom_paged attention needs attn_metadata (run it via ModelRunner)")
    extras = _Extras(softcap or None, s_aux)
    meta = attn_metadata
    # Every attention module that calls it (transformers' and loomllm's) sets its layer's
    # index, an int that nn.Module's type cannot tell from a submodule.
    k_cache, v_cache = meta.kv_caches[cast(int, module.layer_idx)]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    value_dim = value.shape[-1]
    if query.shape[-1] != k_cache.shape[-1] or value_dim != k_cache.shape[-1]:
        # Latent attention's K and V sizes differ: the cache holds both at the larger one.
        # Zeros added to q and k add nothing to a score, and zeros added to v are cut off.
        query, key, value = (_pad_to(t, k_cache.shape[-1]) for t in (query, key, value))
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    q = query[0].transpose(0, 1)  # [T, H, D]
    if meta.paged is not None:
        from loomllm.workers.attention import (
            triton_kernels as triton_attention,  # only where Triton is the backend
        )

        triton_attention.write_kv(
            key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping
        )
        out = attend_written(module, q, meta, scaling, sliding_window, extras)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))
        out = attend_cached(module, q, meta, scaling, sliding_window, extras)
    if value_dim != out.shape[-1]:
        out = out[..., :value_dim]
    return out.unsqueeze(0), None


def _pad_to(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.shape[-1] > dim:
        raise ValueError(f"a head of {t.shape[-1]} dims does not fit the cache's {dim}")
    return t if t.shape[-1] == dim else F.pad(t, (0, dim - t.shape[-1]))


class _Extras(NamedTuple):
    """What some models add to attention's scores: a softcap, and sink logits [H]."""

    softcap: float | None
    sinks: torch.Tensor | None

    def any(self) -> bool:
        return self.softcap is not None or self.sinks is not None


NO_EXTRAS = _Extras(None, None)


def attend_cached(
    module: torch.nn.Module,
    q: torch.Tensor,  # [T, H, D]
    attn_metadata: AttentionMetadata,
    scaling: float | None,
    sliding_window: int | None = None,
    extras: _Extras = NO_EXTRAS,
) -> torch.Tensor:
    """Each row's attention on the torch backend, over a cache that holds the step's K/V
    already (`paged_attention` writes them first; loomllm's model on the CPU, with the C++
    rotary_into_cache): [T, H, D]."""
    meta = attn_metadata
    k_cache, v_cache = meta.kv_caches[cast(int, module.layer_idx)]
    group = q.shape[1] // k_cache.shape[1]
    if not meta.prefills:  # decode only: token i is decode row i, no gather or scatter
        return _decode(q, k_cache, v_cache, meta, group, scaling, sliding_window, extras)
    ops = _cpu_ops(q, k_cache)
    if ops is not None and meta.prefill_batch is not None:
        # Every prompt row in one call, each reading its context in the cache where it lies.
        batch = meta.prefill_batch
        out = ops.prefill_attention(
            q,
            k_cache,
            v_cache,
            batch.slots,
            batch.lens,
            batch.q_starts,
            batch.q_lens,
            scaling if scaling is not None else q.shape[-1] ** -0.5,
            sliding_window or 0,
            extras.softcap or 0.0,
            extras.sinks,
        )
    else:
        out = torch.empty_like(q)  # [T, H, D]
        for row in meta.prefills:
            rows = slice(row.token_start, row.token_start + row.num_tokens)
            out[rows] = _prefill(
                q[rows], k_cache, v_cache, row, group, scaling, sliding_window, extras
            )
    if meta.decode_token_idx.numel():
        out[meta.decode_token_idx] = _decode(
            q[meta.decode_token_idx], k_cache, v_cache, meta, group, scaling, sliding_window, extras
        )
    return out


def _attend(
    q: torch.Tensor,  # [..., rows, D]
    k: torch.Tensor,  # [..., L, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # bool (True: seen) or additive, broadcast to [..., rows, L]
    scale: float | None,
    extras: _Extras,
    sinks: torch.Tensor | None,  # [..., rows, 1]: extras.sinks laid out as q's rows
) -> torch.Tensor:
    """Attention with a softcap and sinks, as transformers' eager Gemma 2 and gpt-oss compute
    it: scores scaled, capped, masked; the sink a last column of the softmax, then dropped."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (
        scale if scale is not None else q.shape[-1] ** -0.5
    )
    if extras.softcap is not None:
        scores = torch.tanh(scores / extras.softcap) * extras.softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1)
    else:
        logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], -1)
        probs = torch.softmax(logits.float(), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def attend_written(
    module: torch.nn.Module,
    q: torch.Tensor,  # [T, H, D]
    attn_metadata: AttentionMetadata,
    scaling: float,
    sliding_window: int | None = None,
    extras: _Extras = NO_EXTRAS,
) -> torch.Tensor:
    """Each row's attention on the Triton backend, over a cache that holds the step's K/V
    already (`paged_attention` writes them first; loomllm's model, with
    fused_ops.rotary_into_cache): [T, H, D]. `extras`: a softcap and sinks."""
    from loomllm.workers.attention import (
        triton_kernels as triton_attention,  # only where Triton is the backend
    )

    meta = attn_metadata
    k_cache, v_cache = meta.kv_caches[cast(int, module.layer_idx)]
    paged = meta.paged
    assert paged is not None
    bs = paged.block_size
    num_decodes = paged.decode_tables.shape[0]
    softcap, sinks = extras
    if num_decodes == q.shape[0]:  # decode only: token i is decode row i
        return _decode_only(module, q, attn_metadata, scaling, sliding_window, extras=extras)
    # Zeros: a mixed-step graph's padded tokens are in no row, and stay finite this way.
    out = torch.zeros_like(q)
    if num_decodes:
        out[meta.decode_token_idx] = triton_attention.decode_attention(
            q[meta.decode_token_idx],
            k_cache,
            v_cache,
            paged.decode_tables,
            paged.decode_lens,
            paged.max_decode_len,
            bs,
            scaling,
            sliding_window,
            split_counts=paged.decode_split_counts,
            softcap=softcap,
            sinks=sinks,
        )
    triton_attention.prefill_attention(
        q,
        k_cache,
        v_cache,
        paged.prefill_tables,
        paged.prefill_q_starts,
        paged.prefill_q_lens,
        paged.prefill_lens,
        paged.prefill_tile_reqs,
        paged.prefill_tile_firsts,
        bs,
        scaling,
        sliding_window,
        out=out,
        softcap=softcap,
        sinks=sinks,
    )
    return out


def attend_rotating(
    module: torch.nn.Module,
    q: torch.Tensor,  # [T, H, D], not rotated yet
    k: torch.Tensor,  # [T, KVH, D], not rotated yet, not in the cache yet
    v: torch.Tensor,
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """A decode-only step's attention on the Triton backend, [T, H, D], the rotary embedding
    and the write of K and V into the cache done by the decode kernel itself (one launch a
    layer, not two); None for a step with prompt rows (the caller rotates and writes first:
    fused_ops.rotary_into_cache, then `attend_written`). The caller checks
    `fused_ops.rotary_into_cache_fits` first.

    Safe because no decode row reads a block another row writes in the same step: a
    running request's blocks were full before it was scheduled, or are its own. A request
    scheduled for the first time (or back after a preemption) may hold a prefix-cached
    block that another row fills in this very step, so the model runner makes its
    one-token row a prompt chunk, never a decode row: its step is not decode-only."""
    paged = attn_metadata.paged
    assert paged is not None
    if paged.decode_tables.shape[0] != q.shape[0]:
        return None
    return _decode_only(
        module,
        q,
        attn_metadata,
        scaling,
        sliding_window,
        new_kv=(k, v, cos, sin, attn_metadata.slot_mapping),
    )


def _decode_only(
    module: torch.nn.Module,
    q: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    sliding_window: int | None,
    new_kv: tuple[torch.Tensor, ...] | None = None,
    extras: _Extras = NO_EXTRAS,
) -> torch.Tensor:
    """A decode-only step's attention: token i is decode row i, all through the decode
    kernel (`new_kv`: see triton_attention.decode_attention)."""
    from loomllm.workers.attention import (
        triton_kernels as triton_attention,  # only where Triton is the backend
    )

    k_cache, v_cache = meta.kv_caches[cast(int, module.layer_idx)]
    paged = cast(PagedBatch, meta.paged)  # both callers checked that it is set
    return triton_attention.decode_attention(
        q,
        k_cache,
        v_cache,
        paged.decode_tables,
        paged.decode_lens,
        paged.max_decode_len,
        paged.block_size,
        scaling,
        sliding_window,
        split_counts=paged.decode_split_counts,
        new_kv=new_kv,
        softcap=extras.softcap,
        sinks=extras.sinks,
    )


def _decode(
    q: torch.Tensor,  # [Bd, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    group: int,
    scaling: float | None,
    sliding_window: int | None,
    extras: _Extras,
) -> torch.Tensor:
    bd, num_heads, dim = q.shape
    ops = _cpu_ops(q, k_cache)
    if ops is not None:
        # The C++ kernel reads each row's keys in the cache where they are, no gather.
        return ops.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_slots,
            meta.decode_lens,
            scaling if scaling is not None else dim**-0.5,
            sliding_window or 0,
            extras.softcap or 0.0,
            extras.sinks,
        )
    k = _gather(k_cache, meta.decode_slots, q.dtype)  # [Bd, KVH, L, D]
    v = _gather(v_cache, meta.decode_slots, q.dtype)
    mask = meta.decode_bias
    if sliding_window is not None:
        valid = meta.decode_valid & _window_keep(meta.decode_valid, sliding_window)
        mask = valid[:, None, None, :]
    # GQA without copying K/V: the `group` query heads sharing a KV head become query rows.
    qg = q.view(bd, num_heads // group, group, dim)  # [Bd, KVH, G, D]
    if extras.any():
        sinks = None if extras.sinks is None else extras.sinks.view(1, -1, group, 1)
        o = _attend(qg, k, v, mask, scaling, extras, sinks)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(bd, num_heads, dim)  # [Bd, H, D]


def _prefill(
    q: torch.Tensor,  # [n, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    group: int,
    scaling: float | None,
    sliding_window: int | None,
    extras: _Extras,
) -> torch.Tensor:
    n, num_heads, dim = q.shape
    seq_len = row.context_slots.numel()
    k = _gather(k_cache, row.context_slots[None], q.dtype)[0]  # [KVH, L, D]
    v = _gather(v_cache, row.context_slots[None], q.dtype)[0]
    # Query j sits at absolute position seq_len - n + j and sees keys up to it.
    q_pos = torch.arange(seq_len - n, seq_len).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(seq_len).unsqueeze(0)  # [1, L]
    mask = k_pos <= q_pos  # [n, L]
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    qg = q.permute(1, 0, 2).reshape(num_heads // group, group * n, dim)  # [KVH, G*n, D]
    if extras.any():
        # Row j of KV head h is query head h * group + j // n.
        sinks = (
            None
            if extras.sinks is None
            else extras.sinks.view(-1, group, 1).repeat_interleave(n, dim=1)
        )
        o = _attend(qg, k, v, mask.repeat(group, 1), scaling, extras, sinks)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(group, 1), scale=scaling)
    return o.view(num_heads, n, dim).permute(1, 0, 2)  # [n, H, D]


def _cpu_ops(q: torch.Tensor, k_cache: torch.Tensor) -> Any | None:
    """The C++ CPU ops, where they compute this attention (a CPU cache in q's dtype)."""
    ops = cpu_native.loaded()
    if (
        ops is not None
        and q.device.type == "cpu"
        and q.dtype == k_cache.dtype
        and q.dtype in cpu_native.DTYPES
    ):
        return ops
    return None


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` [B, L] of a slot-major cache [S, KVH, D], as [B, KVH, L, D].

    index_select on the flat slot list, not `cache[slots]`, because advanced indexing takes
    a slower general path.
    """
    b, length = slots.shape
    rows = cache.index_select(0, slots.reshape(-1)).view(b, length, *cache.shape[1:])
    return rows.transpose(1, 2).to(dtype)


def _window_keep(valid: torch.Tensor, window: int) -> torch.Tensor:
    """For decode rows: keep the last `window` real keys of each row."""
    lengths = valid.sum(dim=1, keepdim=True)  # [Bd, 1]
    k_pos = torch.arange(valid.shape[1]).unsqueeze(0)  # [1, L]
    return k_pos >= lengths - window


def route_transformers_model(model: torch.nn.Module) -> None:
    """Make a transformers model call `paged_attention` (loomllm's own Llama calls it itself,
    and has no attention implementations to pick from)."""
    if hasattr(model, "set_attn_implementation"):
        register()
        hf: Any = model  # a transformers model: nn.Module's type does not know its methods
        hf.set_attn_implementation(ATTENTION_NAME)


def register() -> None:
    """Make `attn_implementation="loom_paged"` available to every HF model (idempotent)."""
    from transformers import AttentionInterface  # only HF models need it: a big import

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    # Masks are built per request inside the attention function, so HF must not build
    # one. An implementation with no mask function makes HF skip mask preparation
    # altogether, including its packed-sequence check on position_ids, whose `.all()`
    # waits for the device in the middle of every forward (stalling async scheduling's
    # launch-ahead, and not allowed inside a CUDA graph capture).
