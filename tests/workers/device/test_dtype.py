"""dtype="auto" on CPU: bfloat16 where the CPU computes it natively, float32 elsewhere.

The detection reads /proc/cpuinfo's flags (fed fake text here) unless $LOOM_CPU_BF16
overrides it; the loaded weights, the KV cache and the reported ModelInfo all follow.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from loomllm.config import EngineConfig
from loomllm.workers.device.cpu_features import CPU_BF16_ENV, cpu_supports_bf16
from loomllm.workers.models.loader import load_model
from loomllm.workers.models.sources import ModelLoadError
from loomllm.workers.worker.state import Worker

AVX2_ONLY = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
AVX512_NO_BF16 = AVX2_ONLY + " avx512f avx512dq avx512bw avx512vl avx512_vnni"


def cpuinfo(*flag_lines: str) -> str:
    """/proc/cpuinfo text with one processor per line of flags."""
    return "\n".join(
        f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nflags\t\t: {flags}"
        "\nbugs\t\t: spectre_v1\n"
        for i, flags in enumerate(flag_lines)
    )


@pytest.mark.parametrize(
    "flags, expected, reason",
    [
        (AVX2_ONLY, False, "neither avx512_bf16 nor amx_bf16"),
        (AVX512_NO_BF16, False, "neither avx512_bf16 nor amx_bf16"),  # oneDNN would emulate
        (AVX512_NO_BF16 + " avx512_bf16", True, "has avx512_bf16"),  # Cooper Lake, Zen 4
        (AVX512_NO_BF16 + " avx512_bf16 amx_bf16 amx_tile", True, "avx512_bf16 and amx_bf16"),
        (AVX512_NO_BF16 + " amx_bf16", True, "has amx_bf16"),
    ],
)
def test_decision_from_cpuinfo_flags(flags: str, expected: bool, reason: str) -> None:
    is_native, why = cpu_supports_bf16(cpuinfo(flags, flags), environ={})
    assert is_native is expected
    assert reason in why


def test_every_processor_must_have_the_flag() -> None:
    assert cpu_supports_bf16(cpuinfo(AVX2_ONLY + " avx512_bf16", AVX2_ONLY), environ={})[0] is False
    # Text with no x86 flags line at all (another architecture): no native bf16 assumed.
    assert cpu_supports_bf16("processor\t: 0\nFeatures\t: fp asimd\n", environ={})[0] is False


@pytest.mark.parametrize("value, expected", [("1", True), (" 0 ", False), ("", False)])
def test_env_override_beats_the_flags(value: str, expected: bool) -> None:
    is_native, why = cpu_supports_bf16(cpuinfo(AVX2_ONLY), environ={CPU_BF16_ENV: value})
    assert is_native is expected
    assert (CPU_BF16_ENV in why) == bool(value.strip())
    # And the other way round: 0 forbids bf16 on a CPU that has it.
    with_bf16 = cpuinfo(AVX512_NO_BF16 + " amx_bf16")
    assert cpu_supports_bf16(with_bf16, environ={CPU_BF16_ENV: "0"})[0] is False


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"LOOM_CPU_BF16 must be 0 or 1 \(or unset\); got 'yes'"):
        cpu_supports_bf16(cpuinfo(AVX2_ONLY), environ={CPU_BF16_ENV: "yes"})


@pytest.mark.parametrize("env, expected", [("1", torch.bfloat16), ("0", torch.float32)])
def test_load_model_auto_follows_the_decision(
    tiny_model: str,
    env: str,
    expected: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, env)
    with caplog.at_level(logging.INFO, logger="loomllm.workers.device.dtype"):
        loaded = load_model(tiny_model, dtype="auto", device="cpu")
    name = str(expected).removeprefix("torch.")
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    assert loaded.dtype == name
    assert f"dtype auto on CPU: {name}, because LOOM_CPU_BF16={env}" in caplog.text


def test_float16_checkpoint_gets_bf16_or_fp32_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(tmp_path)
    assert '"float16"' in (tmp_path / "config.json").read_text()
    for env, expected in [("1", "bfloat16"), ("0", "float32")]:
        monkeypatch.setenv(CPU_BF16_ENV, env)
        assert load_model(str(tmp_path), device="cpu").dtype == expected


def test_explicit_dtype_ignores_the_decision(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert load_model(tiny_model, dtype="float32", device="cpu").dtype == "float32"
    monkeypatch.setenv(CPU_BF16_ENV, "maybe")
    with pytest.raises(ModelLoadError, match="LOOM_CPU_BF16 must be 0 or 1"):
        load_model(tiny_model, device="cpu")


def test_kv_cache_and_model_info_follow_the_weights(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    options = EngineConfig(tiny_model, device="cpu").worker_spec().options
    worker = Worker.start(tiny_model, options, 0, 1, "")
    try:
        assert worker.model_info.dtype == "bfloat16"  # what the engine and `loom models` show
        assert {t.dtype for kv in worker.runner.kv_caches for t in kv} == {torch.bfloat16}
    finally:
        worker.shutdown()
