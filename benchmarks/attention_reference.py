"""The Triton paged-attention kernels against a float64 reference, on random paged batches.

Shared by `loom bench gpu-check` (full shapes, on a GPU) and the tests (small shapes, interpreter).
"""

from __future__ import annotations

import math
import random

import torch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖out − ref‖ / ‖ref‖


def reference(q, k_cache, v_cache, slots, q_len, scale, window, softcap=None, sinks=None):
    """float64 attention of a request's last `q_len` positions over its context `slots`;
    `softcap` caps the scores (Gemma 2), `sinks` [H] add a logit to each softmax (gpt-oss)."""
    seq_len = len(slots)
    k = k_cache[slots].double()  # [L, KVH, D]
    v = v_cache[slots].double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("thd,hld->htl", q.double(), k) * scale  # [H, q_len, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("htl,hld->thd", probs, v)  # [q_len, H, D]


def make_batch(rng, *, num_heads, group, head_dim, block_size, dtype, requests, device="cpu"):
    """A paged cache with shuffled blocks and each request's context in it.

    requests: [(context length, tokens computed this step)]."""
    num_kv_heads = num_heads // group
    pages = [math.ceil(n / block_size) for n, _ in requests]
    blocks = list(range(sum(pages) + 3))  # a few blocks nobody owns
    rng.shuffle(blocks)
    shape = (len(blocks) * block_size, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    tables, taken = [], 0
    for n in pages:
        tables.append(blocks[taken : taken + n])
        taken += n
    width = max(pages)
    block_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )
    total = sum(q for _, q in requests)
    q = torch.randn((total, num_heads, head_dim), generator=gen).to(device, dtype)
    return q, k_cache, v_cache, tables, block_tables


def slots_of(table, seq_len, block_size):
    return [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def mixed_errors(
    requests,
    *,
    num_heads,
    group,
    head_dim,
    block_size,
    dtype,
    window,
    seed,
    num_splits=None,
    decode_max_len=None,
    one_kernel=False,
    split_counts=None,
    decode_tiling=None,
    prefill_tiling=None,
    softcap=None,
    sinks=None,
    device="cpu",
):
    """Requests computing one token go to the decode kernel, the others to the prefill
    kernel, into one packed output, as the model runner does; each request's relative
    error against the reference: [(index, context length, tokens computed, error)].
    `decode_max_len`: the decode kernel's sizing, default the longest decode's context
    (a decode graph passes the longest context the cache holds). `one_kernel`: every
    request through the prefill kernel, as a mixed-step graph runs them (its tile list is
    always padded to the most tiles the batch could take). `split_counts`: the decode
    kernel's counters (default: its own); `decode_tiling` and `prefill_tiling`: the
    kernels' tilings (default: their own); `softcap`, `sinks` [H]: as the kernels take them."""
    from loomllm.workers.attention import triton_kernels as ta
    from loomllm.workers.attention.metadata import max_tiles, prefill_tiles

    rng = random.Random(seed)
    q, k_cache, v_cache, tables, block_tables = make_batch(
        rng,
        num_heads=num_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        requests=requests,
        device=device,
    )
    scale = head_dim**-0.5
    starts = [sum(n for _, n in requests[:i]) for i in range(len(requests))]
    decode = [i for i, (_, n) in enumerate(requests) if n == 1 and not one_kernel]
    prefill = [i for i in range(len(requests)) if i not in decode]
    out = torch.full_like(q, float("nan"))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    lens = ints([n for n, _ in requests])
    if prefill:
        pick = torch.tensor(prefill, device=device)
        q_lens = [requests[i][1] for i in prefill]
        tile_reqs, tile_firsts = prefill_tiles(q_lens, max_tiles(len(q), len(prefill)))
        ta.prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables[pick],
            ints([starts[i] for i in prefill]),
            ints(q_lens),
            lens[pick],
            ints(tile_reqs),
            ints(tile_firsts),
            block_size,
            scale,
            window,
            out=out,
            softcap=softcap,
            sinks=sinks,
            **({"tiling": prefill_tiling} if prefill_tiling else {}),
        )
    if decode:
        pick = torch.tensor(decode, device=device)
        rows = torch.tensor([starts[i] for i in decode], device=device)
        out[rows] = ta.decode_attention(
            q[rows],
            k_cache,
            v_cache,
            block_tables[pick],
            lens[pick],
            decode_max_len or max(requests[i][0] for i in decode),
            block_size,
            scale,
            window,
            num_splits,
            split_counts,
            softcap=softcap,
            sinks=sinks,
            **({"tiling": decode_tiling} if decode_tiling else {}),
        )
    out, q, k_cache, v_cache = (t.cpu() for t in (out, q, k_cache, v_cache))
    errors = []
    for i, (seq_len, n) in enumerate(requests):
        rows = slice(starts[i], starts[i] + n)
        ref = reference(
            q[rows],
            k_cache,
            v_cache,
            slots_of(tables[i], seq_len, block_size),
            n,
            scale,
            window,
            softcap,
            None if sinks is None else sinks.cpu(),
        )
        errors.append((i, seq_len, n, relative_error(out[rows], ref)))
    return errors
