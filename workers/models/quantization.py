"""Weight-only quantization of a loaded model's linear layers on the CPU: GGUF weights run as
they are stored, float checkpoints are quantized on load, and each layer picks its kernel
(dense, int8 or int4) by batch size from what was measured fastest on this machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from loomllm.workers.kernels import cpu_kernel_choice
from loomllm.workers.kernels.cpu_linear import (
    GroupwiseInt4,
    Int4Linear,
    Int8Linear,
    fits_int4,
    fits_int8,
)
from loomllm.workers.models.gguf_weights import StoredWeight, read_stored_weights
from loomllm.workers.models.llama.model import Linear, LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)

# vLLM's option name; None: "gguf" for a GGUF file on the CPU, else "none".
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
# Which kernels may run a layer: "auto" lets the measurement pick among those its weights allow.
CPU_LINEAR_KERNELS = ("auto", *cpu_kernel_choice.KINDS)
_INT8_TYPES = ("Q8_0",)
# The kernels a layer's weights allow, and (where int4 is one) how to get its groups: read
# from the file only if the measurement picks int4 somewhere.
Plan = tuple[frozenset[str], Callable[[], GroupwiseInt4] | None]
_PACKED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class QuantizedKernels:
    """A Linear's kernels: `choice` names the one to run at each calibrated batch size."""

    def __init__(
        self,
        choice: cpu_kernel_choice.Choice,
        int8: Int8Linear | None,
        int4: Int4Linear | None,
    ) -> None:
        self.choice = choice
        self.int8, self.int4 = int8, int4

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kind = self.choice[cpu_kernel_choice.batch_index(rows)]
        if kind == "int4" and self.int4 is not None:
            out = self.int4(x)
        elif kind == "int8" and self.int8 is not None:
            out = self.int8(x)
        else:
            return F.linear(x, weight, bias)
        return out if bias is None else out + bias


def resolve(
    quantization: str | None, source_kind: str, device: torch.device, own_model: bool
) -> str:
    """The quantization a load runs with; ValueError naming what an explicit one cannot do."""
    if quantization is None:
        return "gguf" if source_kind == "gguf" and device.type == "cpu" and own_model else "none"
    if quantization not in QUANTIZATIONS:
        allowed = ", ".join(map(repr, [None, *QUANTIZATIONS]))
        raise ValueError(f"quantization must be one of {allowed}; got {quantization!r}")
    if quantization == "none":
        return quantization
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only (device is {device.type}); "
            "quantization='none' dequantizes the weights instead"
        )
    if not own_model:
        raise ValueError(
            f"quantization={quantization!r} needs loomllm's own Llama-family model "
            "(model_impl 'auto' or 'loom', one rank)"
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
    model: LlamaFamilyForCausalLM,
    quantization: str,
    gguf_path: Path | None,
    cpu_linear_kernel: str,
    cache_dir: Path,
) -> str:
    """Give `model`'s linear layers their quantized kernels; a description for the log."""
    if cpu_linear_kernel not in CPU_LINEAR_KERNELS:
        raise ValueError(
            f"cpu_linear_kernel must be one of {', '.join(CPU_LINEAR_KERNELS)}; "
            f"got {cpu_linear_kernel!r}"
        )
    dtype = model.model.embed_tokens.weight.dtype
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if quantization == "gguf":
        assert gguf_path is not None
        shape = model.shape
        _, stored = read_stored_weights(
            gguf_path, shape.num_attention_heads, shape.num_key_value_heads
        )
        plans = {name: _gguf_plan(name, layer, stored, model) for name, layer in layers.items()}
    else:
        plans = {name: _on_load_plan(layer, quantization) for name, layer in layers.items()}
    shapes: dict[cpu_kernel_choice.Shape, frozenset[str]] = {}
    for name, (kinds, _) in plans.items():
        layer = layers[name]
        key = (layer.in_features, layer.out_features)
        shapes[key] = shapes.get(key, kinds) & kinds
    if cpu_linear_kernel != "auto":  # the user's override, where the weights allow it
        wanted = frozenset({cpu_linear_kernel})
        shapes = {shape: wanted & kinds or frozenset({"dense"}) for shape, kinds in shapes.items()}
    choices = cpu_kernel_choice.choose(shapes, dtype, cache_dir / "cpu_kernels")
    for name, (_, groups) in plans.items():
        layer = layers[name]
        choice = choices[(layer.in_features, layer.out_features)]
        if set(choice) == {"dense"}:
            continue
        int4 = None
        if "int4" in choice and groups is not None:
            weights = groups()
            _check_same_weights(name, weights, layer.weight)
            int4 = Int4Linear(weights, dtype)
        int8 = Int8Linear(layer.weight.detach(), dtype) if "int8" in choice else None
        layer.kernels = QuantizedKernels(choice, int8, int4)
    summary = cpu_kernel_choice.describe(choices)
    logger.info(
        "quantization=%s, %s, %d threads: %s",
        quantization,
        str(dtype).removeprefix("torch."),
        torch.get_num_threads(),
        summary,
    )
    return summary


def _gguf_plan(
    name: str, layer: Linear, stored: dict[str, StoredWeight], model: LlamaFamilyForCausalLM
) -> Plan:
    """The kernels a layer's GGUF storage allows, and how to read its int4 groups."""
    prefix, _, module = name.rpartition(".")
    parts = _PACKED_PARTS.get(module, (module,))
    if name == "lm_head" and model.shape.tie_word_embeddings:
        names = ["model.embed_tokens.weight"]
    else:
        names = [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in parts]
    found = [stored[n] for n in names if n in stored]
    if len(found) < len(names):
        return frozenset({"dense"}), None
    if all(w.is_int4 for w in found) and fits_int4(layer.in_features, layer.out_features):
        return frozenset({"dense", "int4"}), lambda: GroupwiseInt4.cat([w.int4() for w in found])
    if all(w.gguf_type in _INT8_TYPES for w in found) and fits_int8(layer.in_features):
        return frozenset({"dense", "int8"}), None
    return frozenset({"dense"}), None


def _check_same_weights(name: str, groups: GroupwiseInt4, dense: torch.Tensor) -> None:
    """The file's blocks must be the weights the dense layer was loaded with (from the same
    file, through transformers' conversion): a mismatch is a mapping bug, never run."""
    error = (groups.dequantize() - dense.float()).abs().max()
    if error > 0.01 * dense.float().abs().max():
        raise ValueError(f"the GGUF blocks of {name} do not match its converted weights")


def _on_load_plan(layer: Linear, quantization: str) -> Plan:
    """Quantize a float layer; its dense weight becomes the quantized one's values, so every
    kernel computes with the same weights."""
    weight = layer.weight
    if quantization == "int4" and fits_int4(layer.in_features, layer.out_features):
        groups = GroupwiseInt4.from_dense(weight)
        weight.copy_(groups.dequantize().to(weight.dtype))
        return frozenset({"dense", "int4"}), lambda: groups
    if quantization == "int8" and fits_int8(layer.in_features):
        weight.copy_(Int8Linear(weight, torch.float32).dequantize().to(weight.dtype))
        return frozenset({"dense", "int8"}), None
    return frozenset({"dense"}), None
