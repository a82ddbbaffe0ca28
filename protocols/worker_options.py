"""WorkerOptions: what an engine asks of its workers' weights, KV cache and step, typed.

EngineConfig.worker_spec builds it (the defaults live there, once); msgpack carries it to the
engine-manager and JSON on the command line to each rank, both checked against these fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from loomllm.protocols.choices import (
    AttentionBackend,
    CpuLinearKernel,
    Device,
    Dtype,
    ExecutorBackend,
    LoadFormat,
    ModelImpl,
    Quantization,
    Runner,
    WeightDtype,
)
from loomllm.protocols.codec import dataclass_fields, from_dataclass_fields
from loomllm.protocols.errors import MalformedMessageError

# profile_tokens for "a step holds a whole context" (chunked prefill off).
PROFILE_WHOLE_CONTEXT = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """Two engines whose options are equal may share warm workers."""

    runner: Runner
    revision: str | None
    dtype: Dtype
    weight_dtype: WeightDtype | None
    quantization: Quantization | None
    cpu_linear_kernel: CpuLinearKernel
    batch_invariant: bool
    device: Device
    attention_backend: AttentionBackend
    load_format: LoadFormat
    model_impl: ModelImpl
    block_size: int
    kv_cache_memory: int | None  # bytes; None: 1 GiB on the CPU, else from the share below
    gpu_memory_utilization: float  # the share of the GPU this engine's workers may fill
    # The biggest step the engine sends: on CUDA its activations are set aside before the
    # KV cache takes the rest.
    profile_tokens: int
    seed: int
    max_num_seqs: int  # decode graphs are captured for batch sizes up to this
    enforce_eager: bool
    # On CUDA, replica r's ranks take the devices after those of replicas 0..r-1; on the
    # CPU the engine's ranks share the cores.
    data_parallel_rank: int
    data_parallel_size: int
    distributed_executor_backend: ExecutorBackend
    max_loras: int  # LoRA adapters a step may hold; 0: no LoRA
    max_lora_rank: int
    # "ray": the cluster's address, and this machine's address in it where Ray cannot find
    # it (vLLM's VLLM_HOST_IP): the manager's node runs a raylet there.
    ray_address: str | None
    ray_node_ip_address: str | None

    def to_json(self) -> str:
        """A JSON object of the fields, for a rank's command line."""
        names = [f.name for f in fields(self)]
        return json.dumps(dict(zip(names, dataclass_fields(self), strict=True)))

    @classmethod
    def from_json(cls, text: str) -> WorkerOptions:
        """The inverse of to_json, each field checked; MalformedMessageError names what is
        missing, unknown or of the wrong type."""
        value = json.loads(text)
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict) or set(value) != set(names):
            given = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise MalformedMessageError(f"WorkerOptions: expected the fields {names}, got {given}")
        return from_dataclass_fields(cls, [value[name] for name in names])
