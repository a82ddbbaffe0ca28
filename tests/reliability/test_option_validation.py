"""Every SamplingParams field and every Engine option, given bad values, raises a ValueError
whose message starts with the field's name; Engine options fail in the constructor, so
nothing (no manager, no worker) starts. A field added without bad values here fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loomllm import Engine
from loomllm.config import EngineConfig
from loomllm.protocols.sampling import SamplingParams

NAN, INF = float("nan"), float("inf")
HUGE = 2**64  # past what crosses the wire to the workers (msgpack: 64 bits)

BAD_SAMPLING = {
    "n": [0, -1, 1.5, "2", True, None, HUGE],
    "temperature": [-0.1, NAN, INF, -INF, "1", None, True, 10**400],
    "top_p": [0, 0.0, -0.1, 1.01, NAN, INF, "1", None],
    "top_k": [-2, 1.5, "1", None, True, HUGE],
    "min_p": [-0.1, 1.1, NAN, INF, "0", None],
    "seed": [1.5, "1", HUGE, -(2**63) - 1, True, NAN],
    "presence_penalty": [-2.1, 2.1, NAN, INF, "0", None],
    "frequency_penalty": [-2.1, 2.1, NAN, -INF, "0", None],
    "repetition_penalty": [0, -1, NAN, INF, "1", None],
    "stop": ["", [""], [5], [None], ("a", 5), 5, {"a": 1}, {"a"}, b"a"],
    "stop_token_ids": [[-1], [1.5], ["1"], [True], [HUGE], 5, "12", {1: 2}, (None,)],
    "ignore_eos": [1, "true", None],
    "max_tokens": [0, -1, 1.5, "16", True, HUGE],
    "min_tokens": [-1, 1.5, "0", None, 17],  # 17: past the default max_tokens (16)
    "logprobs": [-1, 21, 1.5, "1", True, HUGE],
    "prompt_logprobs": [-1, 21, 1.5, "1", True],
    "skip_special_tokens": [1, "yes", None],
    "include_stop_str_in_output": [0, "no", None],
    "output_kind": [5, -1, "DELTA", 1.0, None, True],
    "logit_bias": [
        {"1": 1.0},
        {-1: 1.0},
        {1.5: 1.0},
        {True: 1.0},
        {HUGE: 1.0},
        {1: NAN},
        {1: INF},
        {1: "1"},
        {1: None},
        {1: 10**400},
        [1],
        "{}",
    ],
    "allowed_token_ids": [[], [-1], [1.5], ["1"], [True], [HUGE], 5, "12", {1: 2}],
    "structured_outputs": [{"regex": "a"}, "json", 5, True],
    "bad_words": ["", [""], ["  "], [5], [None], ("a", 5), 5, {"a": 1}, b"a"],
    "bad_words_token_ids": [
        [[]],
        [[-1]],
        [[1.5]],
        [["1"]],
        [[True]],
        [[HUGE]],
        [5],
        [None],
        5,
        "12",
        {1: 2},
    ],
    "truncate_prompt_tokens": [0, -2, 1.5, -1.0, "1", True, HUGE],
}

BAD_ENGINE = {
    "model": ["", "  ", 5, None, Path("m")],
    "runner": ["embed", "", None, 5, "POOLING"],
    "revision": ["", "  ", 5, "main branch", b"main"],
    "dtype": ["int3", "", None, 5, "FLOAT32"],
    "weight_dtype": ["float32", "int8", "", 5],
    "quantization": ["gptq", "", 5, "NONE", "fp8"],
    "cpu_linear_kernel": ["fp32", "", None, 5, "INT8"],
    "batch_invariant": [1, "yes", None],
    "device": ["tpu", "", None, 5],
    "attention_backend": ["flash", "", None, 5, "Triton"],
    "load_format": ["pt", "", None, 5, "DUMMY"],
    "model_impl": ["vllm", "", None, 5, "LOOM"],
    "max_model_len": [0, -1, 1.5, "512", True, HUGE],
    "max_num_seqs": [0, -1, 1.5, None, HUGE],
    "max_num_batched_tokens": [0, -1, "1", HUGE],
    "block_size": [0, -16, None, 1.5, HUGE],
    "kv_cache_memory": [0, -1, 1.5, "1G", HUGE],
    "gpu_memory_utilization": [0, 1.1, -0.5, NAN, INF, "0.9", None, True],
    "enable_prefix_caching": [1, "yes", None],
    "enable_chunked_prefill": [0, None],
    "async_scheduling": [0, 1, 1.0, "on"],
    "enforce_eager": [0, "yes", None],
    "seed": [1.5, "0", None, True, HUGE],
    "tensor_parallel_size": [0, -1, 1.5, None, HUGE],
    "data_parallel_size": [0, -1, 1.5, None, "2", True, HUGE],
    "distributed_executor_backend": ["mp", "", None, 5, "Ray"],
    "keep_alive": [-5, -0.5, -INF, NAN, "300", None, True, HUGE],
    "manager": ["remote", "", None, 5],
    "scheduling_policy": ["lifo", "", None, 5, "FCFS"],
    "generation_config": ["", None, 5, "/nonexistent/loom-generation-config"],
    "manager_socket": [5, "", b"/tmp/m.sock", "/tmp/a\0b", "/tmp/" + "x" * 200],
    "enable_lora": [1, "yes", None],
    "max_loras": [0, -1, 1.5, None, HUGE],
    "max_lora_rank": [0, -1, "8", None, HUGE],
    "speculative_config": [
        5,
        "ngram",
        {"method": "ngram"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 17},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1.5},
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 3,
            "prompt_lookup_max": 2,
        },
        {"method": "ngram", "num_speculative_tokens": 2, "k": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "model": "m"},
        {"method": "eagle", "num_speculative_tokens": 2},
        {"method": "draft_model", "num_speculative_tokens": 2},
        {
            "method": "draft_model",
            "model": "m",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 2,
        },
        *(
            {
                "method": "draft_model",
                "model": "m",
                "num_speculative_tokens": 2,
                "draft_gpu_memory_fraction": fraction,
            }
            # 0.95: past gpu_memory_utilization (0.9), of which it is the draft's share.
            for fraction in (0, 1, -0.1, 0.95, NAN, "0.1", None)
        ),
    ],
}


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_field_has_bad_values():
    assert set(BAD_SAMPLING) == field_names(SamplingParams)
    assert set(BAD_ENGINE) == field_names(EngineConfig)


@pytest.mark.parametrize("name", sorted(BAD_SAMPLING))
def test_bad_sampling_value_names_the_field(name):
    for value in BAD_SAMPLING[name]:
        with pytest.raises(ValueError, match=f"^{name} "):
            SamplingParams(**{name: value})


@pytest.mark.parametrize("name", sorted(BAD_ENGINE))
def test_bad_engine_option_fails_in_the_constructor(name, tmp_path):
    # A socket nobody listens on: were anything started, it would be a manager there.
    socket = tmp_path / "m.sock"
    for value in BAD_ENGINE[name]:
        options = {"manager_socket": socket, name: value}
        with pytest.raises(ValueError, match=f"^{name} "):
            Engine(**options)
    assert list(tmp_path.iterdir()) == []


def test_good_values_pass():
    """The edges of each range are accepted (the bad lists above are not too strict)."""
    SamplingParams(
        n=1,
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        seed=-(2**63),
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-9,
        stop=None,
        stop_token_ids=None,
        max_tokens=None,
        min_tokens=0,
        logprobs=20,
        prompt_logprobs=0,
        output_kind=2,
    )
    SamplingParams(stop="x", stop_token_ids=[0, 2**63 - 1], seed=2**63 - 1, max_tokens=1)
    config = EngineConfig(
        model="m",
        max_model_len=2**63 - 1,
        gpu_memory_utilization=1,
        keep_alive=-1,
        seed=-(2**63),
        manager_socket="/tmp/m.sock",
    )
    assert config.manager_socket == Path("/tmp/m.sock")
    EngineConfig(keep_alive=INF, weight_dtype=None, kv_cache_memory=1)
