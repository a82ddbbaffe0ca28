"""The Triton paged-attention kernels, run on the CPU by Triton's interpreter, against a float64
reference: random shapes (head dims 64/128, GQA 1/4/8, block sizes 16/32, contexts from 1
token up, prefill, chunked prefill and decode in one batch, sliding windows), in float32
and bfloat16. Small shapes here; the GPU benchmark runs the full ones.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from workers import triton_attention as ta  # under TRITON_INTERPRET=1: see conftest.py

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖out − ref‖ / ‖ref‖


def reference(q, k_cache, v_cache, slots, q_len, scale, window):
    """float64 attention of a request's last `q_len` positions over its context `slots`."""
    seq_len = len(slots)
    k = k_cache[slots].double()  # [L, KVH, D]
    v = v_cache[slots].double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("thd,hld->htl", q.double(), k) * scale  # [H, q_len, L]
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("htl,hld->thd", scores.softmax(-1), v)  # [q_len, H, D]


def make_batch(rng, *, num_heads, group, head_dim, block_size, dtype, requests):
    """A paged cache with shuffled blocks and each request's context in it.

    requests: [(context length, tokens computed this step)]."""
    num_kv_heads = num_heads // group
    pages = [math.ceil(n / block_size) for n, _ in requests]
    blocks = list(range(sum(pages) + 3))  # a few blocks nobody owns
    rng.shuffle(blocks)
    shape = (len(blocks) * block_size, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, taken = [], 0
    for n in pages:
        tables.append(blocks[taken : taken + n])
        taken += n
    width = max(pages)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    total = sum(q for _, q in requests)
    q = torch.randn((total, num_heads, head_dim), generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, block_tables


def slots_of(table, seq_len, block_size):
    return [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_mixed(requests, *, num_heads, group, head_dim, block_size, dtype, window, seed,
              num_splits=None):  # fmt: skip
    """Requests computing one token go to the decode kernel, the others to the prefill
    kernel, into one packed output, as the model runner does; checked against reference."""
    rng = random.Random(seed)
    q, k_cache, v_cache, tables, block_tables = make_batch(
        rng, num_heads=num_heads, group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype, requests=requests,
    )  # fmt: skip
    scale = head_dim**-0.5
    starts = [sum(n for _, n in requests[:i]) for i in range(len(requests))]
    decode = [i for i, (_, n) in enumerate(requests) if n == 1]
    prefill = [i for i, (_, n) in enumerate(requests) if n > 1]
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor([n for n, _ in requests], dtype=torch.int32)
    if prefill:
        pick = torch.tensor(prefill)
        ta.prefill_attention(
            q, k_cache, v_cache, block_tables[pick],
            torch.tensor([starts[i] for i in prefill], dtype=torch.int32),
            torch.tensor([requests[i][1] for i in prefill], dtype=torch.int32), lens[pick],
            max(requests[i][1] for i in prefill), block_size, scale, window, out=out,
        )  # fmt: skip
    if decode:
        pick = torch.tensor(decode)
        rows = torch.tensor([starts[i] for i in decode])
        out[rows] = ta.decode_attention(
            q[rows], k_cache, v_cache, block_tables[pick], lens[pick],
            int(lens[pick].max()), block_size, scale, window, num_splits,
        )  # fmt: skip
    for i, (seq_len, n) in enumerate(requests):
        rows = slice(starts[i], starts[i] + n)
        ref = reference(q[rows], k_cache, v_cache, slots_of(tables[i], seq_len, block_size), n,
                        scale, window)  # fmt: skip
        err = relative_error(out[rows], ref)
        assert err < TOLERANCE[dtype], (i, seq_len, n, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group, block_size", [(64, 1, 16), (128, 4, 32), (64, 8, 16)])
def test_mixed_batch_matches_float64(head_dim, group, block_size, dtype):
    # A decode at 1 token, decodes across several pages, a whole prompt, a chunk of a
    # prompt whose start is already cached, and one longer than BLOCK_M queries.
    requests = [(1, 1), (37, 1), (70, 1), (9, 9), (50, 20), (45, 40)]
    run_mixed(requests, num_heads=group * 2, group=group, head_dim=head_dim,
              block_size=block_size, dtype=dtype, window=None, seed=head_dim + group)  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_with_and_without_a_window(seed):
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(1, 5)):
        seq_len = rng.randint(1, 150)
        requests.append((seq_len, rng.choice([1, 1, rng.randint(1, seq_len)])))
    group = rng.choice([1, 4, 8])
    run_mixed(requests, num_heads=group * rng.choice([1, 2]), group=group,
              head_dim=rng.choice([64, 128]), block_size=rng.choice([16, 32]),
              dtype=torch.float32, window=rng.choice([None, 7, 40]), seed=seed)  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_agree(num_splits):
    """However the context is split, the merged result is the same attention."""
    requests = [(130, 1), (17, 1), (64, 1)]
    run_mixed(requests, num_heads=8, group=4, head_dim=64, block_size=16,
              dtype=torch.float32, window=None, seed=5, num_splits=num_splits)  # fmt: skip


def test_bad_layouts_are_refused():
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(64, 2, 64)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        ta.decode_attention(q, cache, cache, tables, lens, 1, 8, 1.0)
    with pytest.raises(ValueError, match="4 query heads do not share 3 KV heads"):
        ta.decode_attention(q, torch.zeros(64, 3, 64), torch.zeros(64, 3, 64), tables, lens, 1,
                            16, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ta.decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache, cache,
                            tables, lens, 1, 16, 1.0)  # fmt: skip
