"""WorkerOptions across both boundaries: msgpack to the manager, JSON to a rank."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loomllm.config import EngineConfig
from loomllm.protocols.codec import decode, encode
from loomllm.protocols.errors import MalformedMessageError
from loomllm.protocols.messages import AcquireWorkers
from loomllm.protocols.worker_options import WorkerOptions

OPTIONS = (
    EngineConfig("m", dtype="float32", enable_lora=True).worker_spec(data_parallel_rank=0).options
)


def test_the_options_round_trip_through_json_and_msgpack():
    assert WorkerOptions.from_json(OPTIONS.to_json()) == OPTIONS
    spec = EngineConfig("m").worker_spec()
    assert decode(encode(AcquireWorkers(spec, 1.0, "e"))).spec == spec


def test_a_value_outside_its_choices_is_refused_naming_the_field():
    bad = replace(OPTIONS, dtype="float8")
    with pytest.raises(MalformedMessageError, match=r"WorkerOptions\.dtype: expected one of "):
        WorkerOptions.from_json(bad.to_json())
    spec = replace(EngineConfig("m").worker_spec(), options=bad)
    with pytest.raises(MalformedMessageError, match=r"spec\.options\.dtype: expected one of"):
        decode(encode(AcquireWorkers(spec, 1.0, "e")))
    # A bool is not the int 1 of a choice, nor an int a str.
    with pytest.raises(MalformedMessageError, match=r"\.block_size: expected int"):
        WorkerOptions.from_json(replace(OPTIONS, block_size=True).to_json())


def test_missing_or_unknown_fields_are_refused():
    fields = json.loads(OPTIONS.to_json())
    with pytest.raises(MalformedMessageError, match="expected the fields"):
        WorkerOptions.from_json(json.dumps({k: v for k, v in fields.items() if k != "seed"}))
    with pytest.raises(MalformedMessageError, match="expected the fields"):
        WorkerOptions.from_json(json.dumps({**fields, "warp": 9}))
    with pytest.raises(MalformedMessageError, match="expected the fields"):
        WorkerOptions.from_json("[]")


def test_lora_asks_for_transformers_model_unquantized_and_eager():
    assert (OPTIONS.model_impl, OPTIONS.quantization, OPTIONS.enforce_eager) == (
        "transformers",
        "none",
        True,
    )
    assert (OPTIONS.max_loras, OPTIONS.max_lora_rank) == (1, 16)
    assert EngineConfig("m").worker_spec().options.max_loras == 0
