"""The Triton paged-attention kernels, run on the CPU by Triton's interpreter, against a float64
reference: random shapes (head dims 64/128, GQA 1/4/8, block sizes 16/32, contexts from 1
token up, prefill, chunked prefill and decode in one batch, sliding windows), in float32
and bfloat16. Small shapes here; `loom bench gpu-check` runs the full ones on a GPU (the
reference and the batches: benchmarks/attention_reference.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from loomllm.benchmarks.attention_reference import TOLERANCE, mixed_errors
from loomllm.workers.attention import (
    triton_kernels as ta,  # under TRITON_INTERPRET=1: see conftest.py
)
from loomllm.workers.attention.metadata import max_tiles, prefill_tiles
from loomllm.workers.kernels import fused_ops

pytestmark = pytest.mark.compute


def run_mixed(requests, *, dtype, **kwargs):
    for i, seq_len, n, err in mixed_errors(requests, dtype=dtype, **kwargs):
        assert err < TOLERANCE[dtype], (i, seq_len, n, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group, block_size", [(64, 1, 16), (128, 4, 32), (64, 8, 16)])
def test_mixed_batch_matches_float64(head_dim, group, block_size, dtype):
    # A decode at 1 token, decodes across several pages, a whole prompt, a chunk of a
    # prompt whose start is already cached, and one longer than BLOCK_M queries.
    requests = [(1, 1), (37, 1), (70, 1), (9, 9), (50, 20), (45, 40)]
    run_mixed(
        requests,
        num_heads=group * 2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        window=None,
        seed=head_dim + group,
    )


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_with_and_without_a_window(seed):
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(1, 5)):
        seq_len = rng.randint(1, 150)
        requests.append((seq_len, rng.choice([1, 1, rng.randint(1, seq_len)])))
    group = rng.choice([1, 4, 8])
    run_mixed(
        requests,
        num_heads=group * rng.choice([1, 2]),
        group=group,
        head_dim=rng.choice([64, 128]),
        block_size=rng.choice([16, 32]),
        dtype=torch.float32,
        window=rng.choice([None, 7, 40]),
        seed=seed,
    )


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("group, block_size", [(1, 16), (4, 32)])
def test_one_kernel_for_every_row_with_padded_tiles(group, block_size, window):
    """As a mixed-step graph runs them: decodes are one-query tiles of the prefill kernel,
    and the tile list is padded to the most the batch could take (tiles of request -1)."""
    requests = [(1, 1), (37, 1), (70, 1), (9, 9), (50, 20), (45, 40), (130, 1)]
    run_mixed(
        requests,
        num_heads=group * 2,
        group=group,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        window=window,
        seed=group,
        one_kernel=True,
    )


def test_prefill_tiles_cover_each_query_once():
    reqs, firsts = prefill_tiles([1, 16, 17, 40])
    assert reqs == [0, 1, 2, 2, 3, 3, 3] and firsts == [0, 0, 0, 16, 0, 16, 32]
    # 74 queries of 4 requests take at most 74 // 16 + 4 tiles; pads do nothing.
    reqs, firsts = prefill_tiles([1, 16, 17, 40], max_tiles(74, 4))
    assert len(reqs) == 8 and reqs[7:] == [-1] and firsts[7:] == [0]
    with pytest.raises(ValueError, match="7 tiles do not fit in 6"):
        prefill_tiles([1, 16, 17, 40], 6)


def test_tiles_of_no_request_write_nothing():
    """A padded tile (request -1) leaves `out` as it is, even where request 0 has queries."""
    q = torch.randn(32, 2, 64)
    cache = torch.randn(64, 2, 64)
    ints = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    ta.prefill_attention(
        q,
        cache,
        cache,
        ints([0, 1, 2, 3]),
        ints(0),
        ints(32),
        ints(32),
        ints(-1, -1, -1),
        ints(0, 0, 0),
        16,
        0.125,
        out=out,
    )
    assert out.isnan().all()


@pytest.mark.parametrize("seed", range(3))
def test_max_tiles_bounds_every_step_a_bucket_holds(seed):
    rng = random.Random(seed)
    for _ in range(200):
        rows = rng.randint(1, 64)
        q_lens = [rng.choice([1, 15, 16, 17, 31, 33, rng.randint(1, 100)]) for _ in range(rows)]
        size = sum(q_lens) + rng.randint(0, 63)  # the bucket: at least the step's tokens
        reqs, _ = prefill_tiles(q_lens)
        assert len(reqs) <= max_tiles(size, rows)
        assert sorted(set(reqs)) == list(range(rows))  # every row has a tile
    # The worst case: many 17-token rows take two tiles each.
    assert len(prefill_tiles([17] * 30)[0]) == 60 <= max_tiles(17 * 30, 30)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_agree(num_splits):
    """However the context is split, the merged result is the same attention."""
    requests = [(130, 1), (17, 1), (64, 1)]
    run_mixed(
        requests,
        num_heads=8,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        window=None,
        seed=5,
        num_splits=num_splits,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "keys, block_size, num_splits, window",
    [(16, 32, None, None), (32, 16, 3, None), (64, 16, None, 7), (128, 16, 2, 40), (64, 32, 1, 40)],
)
def test_decode_tilings_agree_with_float64(keys, block_size, num_splits, window, dtype):
    """Keys a step fewer than a page's, or spanning several pages, a split's last pages
    partly past its end, windows starting mid-step: every tiling is the same attention."""
    run_mixed(
        [(1, 1), (16, 1), (17, 1), (95, 1), (130, 1), (257, 1)],
        num_heads=8,
        group=4,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        window=window,
        seed=keys + block_size,
        num_splits=num_splits,
        decode_tiling=ta.AttentionTiling(keys, 4, 2),
    )


@pytest.mark.parametrize("kernel", ["DECODE", "PREFILL"])
@pytest.mark.parametrize("value", ["32x8x2", "48x4x2", "64x4"])
def test_the_tiling_variables_set_the_defaults_or_are_refused(kernel, value):
    """Read where a worker imports the kernels; a bad one stops it with a message naming it."""
    code = f"from loomllm.workers.attention import triton_kernels as t; print(t.{kernel}_TILING)"
    env = {**os.environ, f"LOOM_{kernel}_TILING": value}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if value == "32x8x2":
        assert done.returncode == 0 and done.stdout.strip() == "32x8x2", done.stderr
    else:
        assert done.returncode == 1, done.stdout
        assert f"LOOM_{kernel}_TILING={value!r} is not keys x warps x stages" in done.stderr


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("keys, block_size", [(16, 32), (32, 16), (64, 16), (128, 32)])
def test_prefill_tilings_agree_with_float64(keys, block_size, window):
    """Prompts, chunks over a cached start, and one-query rows as a mixed graph runs them,
    under each tiling: keys a step within a page or over several, windows mid-step."""
    run_mixed(
        [(1, 1), (37, 1), (9, 9), (50, 20), (45, 40), (130, 1), (200, 70)],
        num_heads=8,
        group=4,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        window=window,
        seed=keys + block_size,
        one_kernel=True,
        prefill_tiling=ta.AttentionTiling(keys, 4, 2),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "softcap, with_sinks, num_splits, one_kernel",
    [
        (2.0, False, None, False),
        (None, True, 3, False),
        (3.0, True, 1, False),
        (2.0, True, None, True),
    ],
)
def test_softcaps_and_sinks_agree_with_float64(softcap, with_sinks, num_splits, one_kernel, dtype):
    """Gemma 2's softcap and gpt-oss's sinks in both kernels: a sink counted once however
    many splits the decode merges, windows too."""
    sinks = torch.randn(8) * 2 if with_sinks else None
    for window in (None, 7):
        run_mixed(
            [(1, 1), (37, 1), (130, 1), (9, 9), (50, 20), (45, 40)],
            num_heads=8,
            group=4,
            head_dim=64,
            block_size=16,
            dtype=dtype,
            window=window,
            seed=3,
            num_splits=num_splits,
            one_kernel=one_kernel,
            softcap=softcap,
            sinks=sinks,
        )


def test_decode_tilings_are_checked():
    assert ta.AttentionTiling.parse("64x4x3") == ta.AttentionTiling(64, 4, 3)
    assert str(ta.AttentionTiling(32, 8, 2)) == "32x8x2"
    with pytest.raises(ValueError, match="keys must be a power of two >= 16, got 48"):
        ta.AttentionTiling(48, 4, 2)
    with pytest.raises(ValueError, match="warps must be 1-16"):
        ta.AttentionTiling(64, 3, 2)


def test_the_split_counters_are_left_zero_for_the_next_launch():
    """The last split of a (request, KV head) merges and zeroes its counter: one buffer
    serves a step's layers and a graph's replays, launch after launch."""
    counts = torch.zeros(3 * 2, dtype=torch.int32)
    for seed in range(3):
        run_mixed(
            [(130, 1), (1, 1), (40, 1)],
            num_heads=8,
            group=4,
            head_dim=64,
            block_size=16,
            dtype=torch.bfloat16,
            window=None,
            seed=seed,
            num_splits=3,
            split_counts=counts,
        )
        assert not counts.any()
    q = torch.zeros(3, 8, 64)
    cache = torch.zeros(64, 2, 64)
    tables, lens = torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="split_counts needs 6 int32 zeros, got 5 of"):
        ta.decode_attention(
            q,
            cache,
            cache,
            tables,
            lens,
            64,
            16,
            1.0,
            split_counts=torch.zeros(5, dtype=torch.int32),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits, window", [(None, None), (1, None), (4, 7)])
def test_a_rotating_decode_is_rotary_into_cache_then_the_decode_bit_for_bit(
    dtype, num_splits, window
):
    """q and the new k unrotated: the kernel rotates q, and the split holding each request's
    last position writes its rotated k and its v into the slot before reading the cache."""
    torch.manual_seed(3)
    lens, kv_heads, heads, dim, bs = [1, 17, 40, 33], 2, 8, 64, 16
    pages = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(pages) + 2).tolist()
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(lens))]
    width = max(pages)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    caches = [torch.randn((sum(pages) + 2) * bs, kv_heads, dim).to(dtype) for _ in range(2)]
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = (
        t.view(len(lens), -1, dim)
        for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    pos = torch.tensor(lens) - 1
    angles = pos[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.tensor(
        [t[p // bs] * bs + p % bs for t, p in zip(tables, pos.tolist(), strict=True)]
    )
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (block_tables, seq_lens, max(lens), bs, dim**-0.5, window, num_splits)
    ref_caches = [c.clone() for c in caches]
    q_rot = fused_ops.rotary_into_cache(q, k, v, cos, sin, *ref_caches, slots)
    expected = ta.decode_attention(q_rot, *ref_caches, *args)
    out = ta.decode_attention(q, *caches, *args, new_kv=(k, v, cos, sin, slots))
    assert torch.equal(out, expected)
    assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches, strict=True))
    with pytest.raises(ValueError, match="new_kv: k, v"):
        ta.decode_attention(q, *caches, *args, new_kv=(k, v, cos[:2], sin[:2], slots))


@pytest.mark.parametrize("window", [None, 40])
def test_decode_sized_for_the_longest_context_the_cache_holds(window):
    """As a decode graph runs it: splits for 4096 tokens over contexts of 1 to 130."""
    run_mixed(
        [(130, 1), (1, 1), (17, 1), (64, 1)],
        num_heads=8,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        window=window,
        seed=6,
        decode_max_len=4096,
    )


def test_bad_layouts_are_refused():
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(64, 2, 64)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        ta.decode_attention(q, cache, cache, tables, lens, 1, 8, 1.0)
    with pytest.raises(ValueError, match="4 query heads do not share 3 KV heads"):
        ta.decode_attention(
            q, torch.zeros(64, 3, 64), torch.zeros(64, 3, 64), tables, lens, 1, 16, 1.0
        )
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ta.decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), cache, cache, tables, lens, 1, 16, 1.0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(2, 64), (3, 24)])  # 3, 24: padded to 4, 32
def test_write_kv_is_index_copy(dtype, heads, head_dim):
    """K and V as the attention gets them (transposed views of a packed projection), into
    slots in any order; slots not written keep what they held."""
    torch.manual_seed(8)
    tokens = 5
    packed = torch.randn(1, tokens, 3 * heads * head_dim).to(dtype)
    _, key, value = (t.view(tokens, heads, head_dim) for t in packed[0].chunk(3, -1))
    slots = torch.tensor([7, 0, 31, 8, 16])
    k_cache, v_cache = (torch.randn(32, heads, head_dim).to(dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.index_copy_(0, slots, key)
    v_ref.index_copy_(0, slots, value)
    ta.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    ta.write_kv(
        key.transpose(0, 1).contiguous().transpose(0, 1),  # heads outermost
        value.mT.contiguous().mT,
        k_cache,
        v_cache,
        slots.flip(0),
    )  # a column stride
    k_ref.index_copy_(0, slots.flip(0), key)
    v_ref.index_copy_(0, slots.flip(0), value)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(ValueError, match="copies without casting"):
        ta.write_kv(key.double(), value.double(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="do not fit caches"):
        ta.write_kv(key[:, :1], value[:, :1], k_cache, v_cache, slots)
