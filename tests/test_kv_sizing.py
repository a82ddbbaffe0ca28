"""KV cache sizing: the user's bytes, the CPU default, and the CUDA budget's arithmetic (the
profiling forward itself needs a GPU: `loom bench gpu` logs its figures there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers.kv_sizing import DEFAULT_CPU_KV_CACHE_BYTES, gpu_kv_budget, kv_cache_budget

GiB = 1 << 30


def never(num_blocks: int):
    raise AssertionError("no profiling runner on the CPU")


def test_explicit_bytes_win_and_the_cpu_default_is_bounded():
    small = SimpleNamespace(device="cpu", max_model_len=512)
    big = SimpleNamespace(device="cpu", max_model_len=131072)
    per_block = 16 * 4096  # 16 tokens of 4 KiB
    assert kv_cache_budget(small, {"kv_cache_memory": 12345}, 16, per_block, never) == 12345
    assert kv_cache_budget(small, {}, 16, per_block, never) == 32 * 512 * 4096
    assert kv_cache_budget(big, {}, 16, per_block, never) == DEFAULT_CPU_KV_CACHE_BYTES


def test_gpu_budget_is_the_allowed_share_less_what_is_used_and_the_peak():
    # 80 GiB GPU, 20 GiB in use (weights, context, others), 3 GiB of activations at 0.9.
    assert gpu_kv_budget(80 * GiB, 60 * GiB, 3 * GiB, 0.9) == pytest.approx(49 * GiB)
    # Another process holds most of it: nothing is left, and the worker says so.
    assert gpu_kv_budget(80 * GiB, 10 * GiB, 3 * GiB, 0.9) < 0
