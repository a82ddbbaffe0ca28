"""The allowed values of the options an engine hands its workers, stated once as Literal
types: the options' annotations use them, and each tuple of values is read from its type.
"""

from __future__ import annotations

from typing import Literal, get_args

Runner = Literal["generate", "pooling"]
# "auto": on the CPU bfloat16 where it computes natively, else float32; on CUDA the
# checkpoint's 16-bit dtype, else bfloat16.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# A float32 model's linear weights stored in 16 bits; None: as the model is.
WeightDtype = Literal["bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
# torch: the reference, and the CPU's backend; triton: attention/triton_kernels.py (CUDA);
# "auto": triton on CUDA, torch elsewhere.
AttentionBackend = Literal["auto", "torch", "triton"]
# "dummy": random weights from the config, on the device (vLLM's, for benchmarks).
LoadFormat = Literal["auto", "dummy"]
# "auto": loomllm's own Llama-family model where it runs the checkpoint, else transformers'
# modeling code; "loom": its own or an error; "transformers": transformers' (vLLM's option).
ModelImpl = Literal["auto", "loom", "transformers"]
# Weight-only quantization on the CPU (vLLM's option name). None (not listed): a GGUF file
# runs as it is stored, on the CPU; "none": dequantized; "int8" / "int4": a float checkpoint
# quantized on load.
Quantization = Literal["none", "gguf", "int8", "int4"]
# The kernels that may run a layer quantized on load. a8: the weights' blocks against
# activations quantized to int8 (llama.cpp's arithmetic), on the C++ ops.
CpuKernelKind = Literal["dense", "int8", "int4", "a8"]
# "auto" lets the measurement pick among those a layer's weights allow.
CpuLinearKernel = Literal["auto", CpuKernelKind]
# "local": ranks are processes the engine-manager starts on this machine; "ray": actors
# it places in an existing Ray cluster (address: $RAY_ADDRESS, else the local node's).
ExecutorBackend = Literal["local", "ray"]
# Which waiting request runs first: "fcfs" (arrival order) or "priority" (a request's
# `priority`, lower first, then arrival; preemption gives up the lowest first), as vLLM's.
SchedulingPolicy = Literal["fcfs", "priority"]
# "auto": use (or start) the shared per-user daemon; "private": one that dies with us.
ManagerMode = Literal["auto", "private"]

RUNNERS: tuple[str, ...] = get_args(Runner)
DTYPES: tuple[str, ...] = get_args(Dtype)
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
MODEL_IMPLS: tuple[str, ...] = get_args(ModelImpl)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
CPU_KERNEL_KINDS: tuple[str, ...] = get_args(CpuKernelKind)
CPU_LINEAR_KERNELS: tuple[str, ...] = get_args(CpuLinearKernel)
EXECUTOR_BACKENDS: tuple[str, ...] = get_args(ExecutorBackend)
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
MANAGER_MODES: tuple[str, ...] = get_args(ManagerMode)
