"""Quantization of a float checkpoint's linear layers on load, on the CPU: each layer picks its
kernel (dense, int8, int4, or a8, which quantizes the activations too) from what was measured
fastest on this machine. (A GGUF file runs as stored: models/gguf_model.py.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from loomllm.protocols.choices import QUANTIZATIONS
from loomllm.workers.kernels import cpu_kernel_choice, cpu_native
from loomllm.workers.kernels.cpu_linear import (
    GROUP_SIZE,
    BlockLinear,
    CodeBlocks,
    GroupwiseInt4,
    Int4Linear,
    Int8Linear,
    fits_int4,
    fits_int8,
    int4_values,
)
from loomllm.workers.models.llama.model import Linear, LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


class Plan(NamedTuple):
    """The kernels a layer's weights allow, and how to get its int4 groups and its blocks:
    computed only if the measurement picks a kernel that needs them."""

    kinds: frozenset[str]
    groups: Callable[[], GroupwiseInt4] | None = None
    blocks: Callable[[], CodeBlocks] | None = None


class QuantizedKernels:
    """A Linear's kernels: `choice` names the one to run at each calibrated batch size."""

    def __init__(
        self,
        choice: cpu_kernel_choice.Choice,
        int8: Int8Linear | None,
        int4: Int4Linear | None,
        a8: BlockLinear | None = None,
    ) -> None:
        self.choice = choice
        self.int8, self.int4, self.a8 = int8, int4, a8

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kind = self.choice[cpu_kernel_choice.batch_index(rows)]
        if kind == "int4" and self.int4 is not None:
            out = self.int4(x)
        elif kind == "int8" and self.int8 is not None:
            out = self.int8(x)
        elif kind == "a8" and self.a8 is not None:
            out = self.a8(x)
        else:
            return F.linear(x, weight, bias)
        return out if bias is None else out + bias


def resolve(
    quantization: str | None,
    source_kind: str,
    device: torch.device,
    own_model: bool,
    *,
    weight_dtype: str | None = None,
    dummy: bool = False,
) -> str:
    """The quantization a load runs with; ValueError naming what an explicit one cannot do."""
    if quantization is None:
        runs_as_stored = source_kind == "gguf" and device.type == "cpu" and own_model
        return "gguf" if runs_as_stored and weight_dtype is None and not dummy else "none"
    if quantization not in QUANTIZATIONS:
        allowed = ", ".join(map(repr, [None, *QUANTIZATIONS]))
        raise ValueError(f"quantization must be one of {allowed}; got {quantization!r}")
    if quantization == "none":
        return quantization
    if weight_dtype is not None:
        raise ValueError(
            f"quantization={quantization!r} and weight_dtype={weight_dtype!r} do not go "
            "together: each decides how the linear weights are stored"
        )
    if quantization == "gguf" and dummy:
        raise ValueError(
            "quantization='gguf' runs the file's weights; load_format='dummy' draws random ones"
        )
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only (device is {device.type}); "
            "quantization='none' dequantizes the weights instead"
        )
    if not own_model:
        raise ValueError(
            f"quantization={quantization!r} needs loomllm's own Llama-family model "
            "(model_impl 'auto' or 'loom', one rank, a Llama-family checkpoint)"
        )
    if quantization == "gguf" and source_kind != "gguf":
        raise ValueError("quantization='gguf' is for GGUF files; this model is not one")
    if quantization in ("int8", "int4") and source_kind == "gguf":
        raise ValueError(
            f"quantization={quantization!r} quantizes float checkpoints; a GGUF file is "
            "quantized already (quantization='gguf' runs it as stored, 'none' dequantizes it)"
        )
    return quantization


def quantize(
    model: LlamaFamilyForCausalLM, quantization: str, cpu_linear_kernel: str, cache_dir: Path
) -> str:
    """Give `model`'s linear layers their quantized kernels ("int8" or "int4"); a description
    for the log. `cpu_linear_kernel` is one of CPU_LINEAR_KERNELS (the loader checks it)."""
    dtype = model.model.embed_tokens.weight.dtype
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    plans = {name: _on_load_plan(layer, quantization) for name, layer in layers.items()}
    # a8 runs on the C++ ops, which compute in float32 and bfloat16. Without AVX512-VNNI its
    # portable loop is far slower than the other kernels: it runs only where asked for.
    ops = cpu_native.load(cache_dir) if dtype in cpu_native.DTYPES else None
    if ops is None or (cpu_linear_kernel == "auto" and not ops.block_linear_has_vnni()):
        plans = {name: plan._replace(kinds=plan.kinds - {"a8"}) for name, plan in plans.items()}
    shapes: dict[cpu_kernel_choice.Shape, frozenset[str]] = {}
    for name, plan in plans.items():
        layer = layers[name]
        key = (layer.in_features, layer.out_features)
        # A shape may run a kernel some of its layers lack: those run dense at that size.
        shapes[key] = shapes.get(key, frozenset()) | plan.kinds
    if cpu_linear_kernel != "auto":  # the user's override, where the weights allow it
        wanted = frozenset({cpu_linear_kernel})
        if not any(wanted & kinds for kinds in shapes.values()):
            logger.warning("cpu_linear_kernel=%s: no layer's weights allow it", cpu_linear_kernel)
        shapes = {shape: wanted & kinds or frozenset({"dense"}) for shape, kinds in shapes.items()}
    choices = cpu_kernel_choice.choose(shapes, dtype, cache_dir / "cpu_kernels")
    for name, plan in plans.items():
        layer = layers[name]
        choice = choices[(layer.in_features, layer.out_features)]
        runs = set(choice) & plan.kinds
        int4 = int8 = a8 = None
        values = None
        # The layer computes with its quantized weights at every batch size: the dense fallback
        # then holds what the kernel computes with, so a request's tokens do not depend on its
        # batch.
        if "a8" in runs and plan.blocks is not None:
            blocks = plan.blocks()
            values = blocks.dequantize()
            a8 = BlockLinear(blocks, ops)
        elif "int4" in plan.kinds and plan.groups is not None:
            weights = plan.groups()
            int4 = Int4Linear(weights, dtype)
            values = int4_values(weights, dtype)
        elif "int8" in plan.kinds:
            int8 = Int8Linear(layer.weight.detach(), dtype)
            values = int8.dequantize()
        if values is not None:
            # A new parameter: a tied lm_head leaves the embedding's weight as it is.
            layer.weight = torch.nn.Parameter(values.to(dtype), requires_grad=False)
        if runs - {"dense"}:
            layer.kernels = QuantizedKernels(
                choice,
                int8 if "int8" in runs else None,
                int4 if "int4" in runs else None,
                a8,
            )
    summary = cpu_kernel_choice.describe(choices)
    logger.info(
        "quantization=%s, %s, %d threads: %s",
        quantization,
        str(dtype).removeprefix("torch."),
        torch.get_num_threads(),
        summary,
    )
    return summary


def _on_load_plan(layer: Linear, quantization: str) -> Plan:
    """The kernels quantizing a float layer allows (its groups computed when needed)."""
    fits = fits_int4(layer.in_features, layer.out_features)
    if quantization == "int4" and fits:
        return Plan(
            frozenset({"dense", "int4", "a8"}),
            lambda: GroupwiseInt4.from_dense(layer.weight),
            lambda: CodeBlocks.from_int4(GroupwiseInt4.from_dense(layer.weight)),
        )
    if quantization == "int8" and fits_int8(layer.in_features):

        def blocks() -> CodeBlocks:
            int8 = Int8Linear(layer.weight.detach(), torch.float32)
            groups = layer.in_features // GROUP_SIZE
            return CodeBlocks.from_int8(int8.codes, int8.scale[:, None].expand(-1, groups))

        return Plan(
            frozenset({"dense", "int8"}) | (frozenset({"a8"}) if fits else frozenset()),
            None,
            blocks,
        )
    return Plan(frozenset({"dense"}))
