"""KV cache sizing: the user's bytes, the CPU default, and the CUDA budget's arithmetic (the
profiling forward itself needs a GPU: `loom bench gpu` logs its figures there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loomllm.config import EngineConfig
from loomllm.workers.runner.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    gpu_kv_budget,
    kv_cache_budget,
)

GiB = 1 << 30


def never(num_blocks: int):
    raise AssertionError("no profiling runner on the CPU")


def test_explicit_bytes_win_and_the_cpu_default_is_bounded():
    small = SimpleNamespace(device="cpu", max_model_len=512)
    big = SimpleNamespace(device="cpu", max_model_len=131072)
    per_block = 16 * 4096  # 16 tokens of 4 KiB
    given = EngineConfig("m", kv_cache_memory=12345).worker_spec().options
    default = EngineConfig("m").worker_spec().options
    assert kv_cache_budget(small, given, 16, per_block, never) == 12345
    assert kv_cache_budget(small, default, 16, per_block, never) == 32 * 512 * 4096
    assert kv_cache_budget(big, default, 16, per_block, never) == DEFAULT_CPU_KV_CACHE_BYTES


def test_gpu_budget_is_the_allowed_share_less_what_is_used_and_the_peak():
    # 80 GiB GPU, 20 GiB in use (weights, context, others), 3 GiB of activations at 0.9.
    assert gpu_kv_budget(80 * GiB, 60 * GiB, 3 * GiB, 0.9) == pytest.approx(49 * GiB)
    # Another process holds most of it: nothing is left, and the worker says so.
    assert gpu_kv_budget(80 * GiB, 10 * GiB, 3 * GiB, 0.9) < 0


def test_the_profiling_step_runs_and_splits_past_the_context(tiny_model, monkeypatch):
    """The profiling step, on the CPU with torch.cuda's memory counters stubbed: a step of
    100 tokens on a 64-token context is two requests, every position's logprobs computed."""
    import torch

    from loomllm.workers.models.loader import load_model
    from loomllm.workers.runner.kv_sizing import profile_activation_bytes
    from loomllm.workers.runner.model_runner import ModelRunner

    reserved = iter([1000, 5000, 9000])  # before, with its KV cache, peak
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: next(reserved))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: next(reserved))
    loaded = load_model(tiny_model, dtype="float32")
    runners, steps = [], []

    def make_runner(num_blocks: int) -> ModelRunner:
        runner = ModelRunner(
            loaded.model,
            loaded.config,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=16,
            num_blocks=num_blocks,
        )
        execute = runner.execute
        runner.execute = lambda so, call_id: steps.append(execute(so, call_id))
        runners.append(num_blocks)
        return runner

    peak = profile_activation_bytes("cpu", 100, 16, loaded.vocab_size, 64, make_runner)
    assert peak == 4000 and runners == [4 + 3]  # 64 + 36 tokens in blocks of 16
    (result,) = steps
    assert result.req_ids == ["profile-0", "profile-1"]
    assert [len(p.token_logprobs) for p in result.prompt_logprobs] == [63, 35]
