"""EngineConfig: the engine's options, validated once, before anything starts.

Names follow vLLM's engine arguments. Bad values raise ValueError naming the option.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomllm.protocols.choices import (
    ATTENTION_BACKENDS,
    CPU_LINEAR_KERNELS,
    DEVICES,
    DTYPES,
    EXECUTOR_BACKENDS,
    LOAD_FORMATS,
    MANAGER_MODES,
    MODEL_IMPLS,
    QUANTIZATIONS,
    RUNNERS,
    SCHEDULING_POLICIES,
    WEIGHT_DTYPES,
    AttentionBackend,
    CpuLinearKernel,
    Device,
    Dtype,
    ExecutorBackend,
    LoadFormat,
    ManagerMode,
    ModelImpl,
    Quantization,
    Runner,
    SchedulingPolicy,
    WeightDtype,
)
from loomllm.protocols.messages import WorkerSpec
from loomllm.protocols.worker_options import PROFILE_WHOLE_CONTEXT, WorkerOptions

# max_num_batched_tokens when it is not given and prompts are chunked.
DEFAULT_CHUNKED_TOKEN_BUDGET = 2048


def option(
    default: Any, help: str, *, default_text: str = "", see: str = "", flag: bool = True
) -> Any:
    """An EngineConfig field with what `loom`'s flag and docs/options.md say of it: `help`,
    the default in words where its value says little, and where the docs say more ("below",
    an anchor of options.md, or another page)."""
    metadata = {"help": help, "default_text": default_text, "see": see, "flag": flag}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = option(
        "smollm2", "a path, a GGUF file, a hub id or smollm2 (the embedded one)", flag=False
    )
    runner: Runner = option(
        "generate", "pooling: embeddings (/v1/embeddings)", see="#embeddings-runnerpooling"
    )
    revision: str | None = option(
        None, "a hub model's branch, tag or commit", default_text="its default branch"
    )
    load_format: LoadFormat = option(
        "auto", "dummy: random weights from config.json, for benchmarks", see="below"
    )
    model_impl: ModelImpl = option(
        "auto",
        "auto: loomllm's own Llama-family model where it runs the checkpoint, else "
        "transformers'; loom: its own or an error",
        see="below",
    )
    dtype: Dtype = option(
        "auto", "auto: bfloat16 on a CPU that computes it natively, else float32", see="below"
    )
    weight_dtype: WeightDtype | None = option(
        None,
        "a float32 model's linear weights stored in 16 bits: faster decode on CPUs, at some "
        "accuracy cost",
        default_text="as dtype",
        see="below",
    )
    quantization: Quantization | None = option(
        None,
        "on the CPU: none dequantizes a GGUF; int8 and int4 quantize a float checkpoint",
        default_text="a GGUF as stored",
        see="below",
    )
    cpu_linear_kernel: CpuLinearKernel = option(
        "auto",
        "the CPU's linear kernel with int8/int4: auto, the fastest measured for each shape "
        "and batch size; a8 quantizes the activations to int8 too",
        see="below",
    )
    batch_invariant: bool = option(
        False,
        "a GGUF on the CPU: one linear kernel at every batch size, so that a request's "
        "tokens do not depend on its batch; slower prompts and batches",
        see="below",
    )
    device: Device = option("auto", "auto: CUDA if there is one, else the CPU")
    attention_backend: AttentionBackend = option(
        "auto", "auto: the Triton kernels on CUDA, the torch reference on the CPU", see="gpu.md"
    )
    max_model_len: int | None = option(
        None,
        "longest prompt + output of one request, in tokens, capped by the KV cache",
        default_text="the model's",
    )
    max_num_seqs: int = option(256, "most requests running at once")
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens computed in one step, all requests together",
        default_text="2048; max_model_len without chunked prefill",
    )
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: int | None = option(
        None,
        "KV cache size in bytes",
        default_text="1 GiB on the CPU; on CUDA from gpu_memory_utilization",
    )
    gpu_memory_utilization: float = option(
        0.9, "CUDA: the share of the GPU's memory the workers may fill, in (0, 1]"
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    enable_chunked_prefill: bool = option(
        True, "split long prompts over steps, with decodes alongside"
    )
    scheduling_policy: SchedulingPolicy = option(
        "fcfs",
        "priority: a request's priority, lower first, decides what runs and what is preempted",
        see="#the-async-engine",
    )
    generation_config: str = option(
        "auto",
        "sampling defaults for the fields a request leaves out: auto, the model's "
        "generation_config.json; vllm, SamplingParams' own; or a directory holding one",
        see="below",
    )
    async_scheduling: bool | None = option(
        None,
        "schedule and send step N+1 while step N runs",
        default_text="on, but off with speculative_config; on the CPU for steps of one "
        "request or of whole outputs only",
        see="below",
    )
    speculative_config: dict[str, Any] | None = option(
        None,
        'speculative decoding, as vLLM\'s dict: {"method": "ngram", "num_speculative_tokens": 4}',
        see="#speculative-decoding-speculative_config",
    )
    enable_lora: bool = option(
        False,
        "LoRA adapters per request (--lora-modules, or a request's model)",
        see="#lora-adapters-enable_lora",
    )
    max_loras: int = option(1, "with enable_lora: most different adapters in one step")
    max_lora_rank: int = option(16, "with enable_lora: the largest adapter rank")
    enforce_eager: bool = option(
        False, "CUDA: every step eager, no CUDA graphs nor fused kernels", see="gpu.md"
    )
    seed: int = option(0, "seeds the unseeded requests' generator")
    tensor_parallel_size: int = option(
        1, "ranks each layer's weights and KV heads are split over", see="scaling.md"
    )
    data_parallel_size: int = option(
        1,
        "independent replicas, each with its own scheduler and KV cache; a request goes to "
        "the least loaded",
        see="scaling.md",
    )
    distributed_executor_backend: ExecutorBackend = option(
        "local",
        "ray: ranks as actors of the Ray cluster at $RAY_ADDRESS (pip install 'loomllm[ray]')",
        see="scaling.md",
    )
    keep_alive: float = option(
        300.0, "seconds the workers stay warm after the engine closes; 0: exit with it; -1: pinned"
    )
    manager: ManagerMode = option(
        "auto", "auto: the shared per-user daemon; private: one that dies with us", see="daemon.md"
    )
    manager_socket: Path | None = option(
        None, "another engine-manager's socket", default_text="the per-user one", see="daemon.md"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty string (a path, hub id or 'smollm2')")
        local = Path(self.model).expanduser()
        if local.exists():
            # A path of this process's, made absolute: the workers resolve it in the
            # manager daemon's directory, where a relative one names another file or none.
            object.__setattr__(self, "model", os.path.abspath(local))
        if self.revision is not None and (
            not isinstance(self.revision, str)
            or not self.revision
            or self.revision.split() != [self.revision]
        ):
            raise ValueError(
                f"revision must be a branch, tag or commit name, or None; got {self.revision!r}"
            )
        _one_of("runner", self.runner, RUNNERS)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        _one_of("model_impl", self.model_impl, MODEL_IMPLS)
        if self.weight_dtype is not None:
            _one_of("weight_dtype", self.weight_dtype, WEIGHT_DTYPES, "or None")
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS, "or None")
        _one_of("cpu_linear_kernel", self.cpu_linear_kernel, CPU_LINEAR_KERNELS)
        _one_of("manager", self.manager, MANAGER_MODES)
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config must be auto, vllm or a directory, got "
                f"{self.generation_config!r}"
            )
        if self.generation_config not in ("auto", "vllm"):
            folder = Path(self.generation_config).expanduser()
            if not folder.is_dir():
                raise ValueError(
                    f"generation_config must be auto, vllm or a directory, got "
                    f"{self.generation_config!r} (no such directory)"
                )
            object.__setattr__(self, "generation_config", os.path.abspath(folder))
        _one_of(
            "distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS
        )
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("data_parallel_size", self.data_parallel_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("block_size", self.block_size)
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if type(self.seed) is not int or not _INT64[0] <= self.seed <= _INT64[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not _is_number(self.gpu_memory_utilization) or not (
            0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enforce_eager",
            "batch_invariant",
        ):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (self.async_scheduling is None or type(self.async_scheduling) is bool):
            raise ValueError(
                f"async_scheduling must be true, false or None (auto), got "
                f"{self.async_scheduling!r}"
            )
        if not _is_number(self.keep_alive) or not (self.keep_alive >= 0 or self.keep_alive == -1):
            raise ValueError(
                f"keep_alive must be seconds >= 0, or -1 to pin, got {self.keep_alive!r}"
            )
        if self.keep_alive == math.inf:  # the manager spells "forever" -1 (pinned), not inf
            object.__setattr__(self, "keep_alive", -1)
        if self.manager_socket is not None:
            object.__setattr__(self, "manager_socket", _socket_path(self.manager_socket))
        if type(self.enable_lora) is not bool:
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.enable_lora and (
            self.runner != "generate"
            or self.tensor_parallel_size > 1
            or self.model_impl == "loom"
            or self.quantization not in (None, "none")
        ):
            raise ValueError(
                "enable_lora runs transformers' model on one rank, unquantized, generating: "
                "not with runner='pooling', tensor_parallel_size > 1, model_impl='loom' or "
                "quantization"
            )
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            if self.runner != "generate":
                raise ValueError("speculative_config is for runner='generate'")
            if spec.draft_gpu_memory_fraction >= self.gpu_memory_utilization:
                raise ValueError(
                    f"speculative_config {DRAFT_GPU_FRACTION_KEY} "
                    f"({spec.draft_gpu_memory_fraction:g}) must be below "
                    f"gpu_memory_utilization ({self.gpu_memory_utilization:g}): it is the "
                    f"draft's share of it"
                )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def target_gpu_memory_utilization(self) -> float:
        """The share of the GPU this engine's own workers may fill: gpu_memory_utilization,
        less a draft model's share (draft_gpu_memory_fraction), which its engine fills."""
        spec = self.speculative
        fraction = spec.draft_gpu_memory_fraction if spec is not None else 0.0
        return self.gpu_memory_utilization - fraction

    def worker_spec(self, data_parallel_rank: int = 0) -> WorkerSpec:
        """What one replica's workers hold; engines with equal specs share warm workers."""
        lora = self.enable_lora
        ray = self.distributed_executor_backend == "ray"
        options = WorkerOptions(
            runner=self.runner,
            revision=self.revision,
            dtype=self.dtype,
            weight_dtype=self.weight_dtype,
            # LoRA runs transformers' model, eager: each adapter's layers wrap its linears.
            quantization="none" if lora else self.quantization,
            cpu_linear_kernel=self.cpu_linear_kernel,
            batch_invariant=self.batch_invariant,
            device=self.device,
            attention_backend=self.attention_backend,
            load_format=self.load_format,
            model_impl="transformers" if lora else self.model_impl,
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.target_gpu_memory_utilization,
            profile_tokens=self.max_num_batched_tokens
            or (
                DEFAULT_CHUNKED_TOKEN_BUDGET
                if self.enable_chunked_prefill
                else self.max_model_len or PROFILE_WHOLE_CONTEXT
            ),
            seed=self.seed,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager or lora,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            max_loras=self.max_loras if lora else 0,
            max_lora_rank=self.max_lora_rank if lora else 0,
            ray_address=(os.environ.get("RAY_ADDRESS") or "auto") if ray else None,
            ray_node_ip_address=os.environ.get("LOOM_HOST_IP") if ray else None,
        )
        return WorkerSpec(self.model, self.tensor_parallel_size, options)


# Speculative decoding (vLLM's speculative_config): drafts proposed on the engine's side
# (core/ngram_proposer.py), verified by the workers in the step's one forward.
SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_KEYS = {"prompt_lookup_max", "prompt_lookup_min"}
# A draft model's own options, as vLLM's speculative_config names them.
DRAFT_KEYS = {"model", "dtype", "quantization", "max_model_len", "revision"}
# On CUDA the target's worker sizes its KV cache first, to gpu_memory_utilization of the GPU
# less this share, which the draft's worker then fills (its weights, KV cache, activations):
# the two are separate engines, and the first to size would otherwise leave the other none.
DRAFT_GPU_FRACTION_KEY = "draft_gpu_memory_fraction"
DEFAULT_DRAFT_GPU_FRACTION = 0.1
MAX_SPECULATIVE_TOKENS = 16  # a step verifies 1 + k tokens per request


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # SPECULATIVE_METHODS
    num_speculative_tokens: int  # k: most draft tokens a request gets per step
    prompt_lookup_max: int = 0  # ngram: longest n-gram matched
    prompt_lookup_min: int = 0  # ngram: shortest n-gram matched
    model: str | None = None  # draft_model: the model that drafts (its tokenizer the same)
    # draft_model: the draft engine's own options (dtype, quantization, max_model_len).
    draft_options: tuple[tuple[str, Any], ...] = ()
    draft_gpu_memory_fraction: float = 0.0  # draft_model: the GPU's share set aside for it

    @classmethod
    def parse(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict, checked: ValueError naming the key that is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        method = value.get("method")
        if method is None and value.get("model") is not None:
            method = "draft_model"  # vLLM's: a model given without a method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {method!r}"
            )
        own = DRAFT_KEYS | {DRAFT_GPU_FRACTION_KEY} if method == "draft_model" else NGRAM_KEYS
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", *own})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys for {method}: {unknown}")
        k = value.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config method 'draft_model' needs a model")
            options = tuple(
                sorted((key, value[key]) for key in DRAFT_KEYS - {"model"} if key in value)
            )
            fraction = value.get(DRAFT_GPU_FRACTION_KEY, DEFAULT_DRAFT_GPU_FRACTION)
            if not _is_number(fraction) or not 0 < fraction < 1:
                raise ValueError(
                    f"speculative_config {DRAFT_GPU_FRACTION_KEY} must be in (0, 1), got "
                    f"{fraction!r}"
                )
            return cls(
                method,
                k,
                model=model,
                draft_options=options,
                draft_gpu_memory_fraction=float(fraction),
            )
        # Defaults: n-grams of 1 token up to k tokens (at least the minimum given).
        low = _lookup(value, "prompt_lookup_min", 1)
        high = _lookup(value, "prompt_lookup_max", max(k, low))
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max "
                f"({high})"
            )
        return cls(method, k, high, low)


def _lookup(value: Mapping[str, Any], name: str, default: int) -> int:
    n = value.get(name, default)
    if n is None:
        return default
    if type(n) is not int or n < 1:
        raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
    return n


_INT64 = (-(2**63), 2**63 - 1)  # what crosses the wire to the workers (msgpack)
# sockaddr_un.sun_path is 108 bytes on Linux, its terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or not 1 <= value <= _INT64[1]:
        raise ValueError(f"{name} must be an integer in [1, 2**63), got {value!r}")


def _is_number(value: object) -> bool:
    """A 64-bit int or a float but NaN (infinity passes: a bound checks it); never a bool."""
    if type(value) is int:
        return _INT64[0] <= value <= _INT64[1]
    return type(value) is float and not math.isnan(value)


def _socket_path(value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ValueError(f"manager_socket must be a path, got {value!r}")
    path = os.fsencode(value)
    if b"\0" in path or len(path) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"manager_socket must be a Unix socket path of at most "
            f"{MAX_SOCKET_PATH_BYTES} bytes with no NUL, got {value!r}"[:400]
        )
    return Path(os.fsdecode(path))


def _one_of(name: str, value: object, allowed: tuple[str, ...], also: str = "") -> None:
    if value not in allowed:
        also = f" {also}" if also else ""
        raise ValueError(f"{name} must be one of {', '.join(allowed)}{also}; got {value!r}")
