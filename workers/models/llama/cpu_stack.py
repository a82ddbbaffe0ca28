"""A step's decoder layers in one call to the C++ ops on the CPU (cpu_stack.cpp): the kernels
each linear layer runs at the step's batch size, laid out as that call takes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from loomllm.workers.kernels import cpu_kernel_choice, cpu_native
from loomllm.workers.kernels.gguf_linear import GgufLinear, RepackedLinear

if TYPE_CHECKING:
    from loomllm.workers.models.llama.model import DecoderLayer, LlamaFamilyForCausalLM

# How the C++ stack runs each linear layer: cpu_stack.cpp's LinearMode, its one source.
LINEAR_MODES = cpu_native.cpp_enum("cpu_stack.cpp", "LinearMode")
DENSE, INT4, INT8, A8, GGUF = (LINEAR_MODES[m] for m in ("DENSE", "INT4", "INT8", "A8", "GGUF"))


def linear_args(linear: torch.nn.Module, rows: int) -> tuple[int, list[torch.Tensor | None]]:
    """(mode, its three tensors) of the kernel `linear` runs on `rows` rows, as its forward
    picks it (models/quantization.py's QuantizedKernels, or the dense weight); a GGUF layer's
    parts are GgufParts's."""
    if isinstance(linear, GgufLinear):
        return GGUF, [None, None, linear.bias]
    if isinstance(linear, RepackedLinear):
        return A8, [linear.a8.packed, linear.a8.scales, linear.bias]
    kernels = getattr(linear, "kernels", None)
    if kernels is not None:
        kind = kernels.choice[cpu_kernel_choice.batch_index(rows)]
        if kind == "int4" and kernels.int4 is not None:
            return INT4, [kernels.int4.packed, kernels.int4.scale_zero, linear.bias]
        if kind == "int8" and kernels.int8 is not None:
            return INT8, [kernels.int8.codes, kernels.int8.scale, linear.bias]
        if kind == "a8" and kernels.a8 is not None:
            return A8, [kernels.a8.packed, kernels.a8.scales, linear.bias]
    dense = cast(torch.nn.Linear, linear)  # the stack takes no other kind of layer
    return DENSE, [dense.weight, None, dense.bias]


class GgufParts:
    """The GGUF layers' parts, in the order of their modes, as decode_layers takes them."""

    def __init__(self, model: LlamaFamilyForCausalLM) -> None:
        self.weights: list[torch.Tensor] = []
        self.types: list[int] = []
        self.heads: list[int] = []
        self.counts: list[int] = []
        self.kernel = 0  # gguf_linear's, the same for every layer
        for layer in cast("Iterable[DecoderLayer]", model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            # Typed as modules: the class declares the dense Linear layers GGUF ones replaced.
            linears: tuple[torch.nn.Module, ...] = (
                attn.qkv_proj,
                attn.o_proj,
                mlp.gate_up_proj,
                mlp.down_proj,
            )
            for linear in linears:
                if isinstance(linear, GgufLinear):
                    self.weights += linear.tensors
                    self.types += linear.types
                    self.heads += linear.heads
                    self.counts.append(len(linear.tensors))
                    self.kernel = linear.kernel


class DecoderStack:
    """The layers' tensors and kernel modes for each calibrated batch size, built on first
    use (the weights never change once loaded)."""

    def __init__(self, model: LlamaFamilyForCausalLM, ops: Any) -> None:
        # A ModuleList's items are typed as Module: these are DecoderLayers.
        self.layers = cast("Iterable[DecoderLayer]", model.model.layers)
        self.shape = model.shape
        self.ops = ops
        self.gguf = GgufParts(model)
        self._plans: dict[int, tuple[list[torch.Tensor | None], list[int]]] = {}

    def plan(self, rows: int) -> tuple[list[torch.Tensor | None], list[int]]:
        index = cpu_kernel_choice.batch_index(rows)
        if index not in self._plans:
            weights: list[torch.Tensor | None] = []
            modes: list[int] = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
                if self.shape.qk_norm:
                    weights += [attn.q_norm.weight, attn.k_norm.weight]
                else:
                    weights += [None, None]
                for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                    mode, tensors = linear_args(linear, rows)
                    modes.append(mode)
                    weights += tensors
            self._plans[index] = (weights, modes)
        return self._plans[index]

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual before it), [T, size] each, of the
        step's embeddings `hidden` [T, size] and rotary cos, sin [T, D]. A step with prompt
        rows needs the torch backend's PrefillBatch in `meta`."""
        shape = self.shape
        weights, modes = self.plan(hidden.shape[0])
        prompts: tuple[torch.Tensor | None, ...] = (None,) * 5
        if meta.prefills:
            batch = meta.prefill_batch
            prompts = (
                meta.decode_token_idx,
                batch.slots,
                batch.lens,
                batch.q_starts,
                batch.q_lens,
            )
        return self.ops.decode_layers(
            hidden,
            weights,
            modes,
            [k for k, _ in meta.kv_caches],
            [v for _, v in meta.kv_caches],
            shape.rms_norm_eps,
            shape.num_attention_heads,
            shape.num_key_value_heads,
            shape.head_dim,
            cos,
            sin,
            meta.slot_mapping,
            meta.decode_slots,
            meta.decode_lens,
            shape.head_dim**-0.5,
            shape.sliding_window or 0,
            *prompts,
            self.gguf.weights,
            self.gguf.types,
            self.gguf.heads,
            self.gguf.counts,
            self.gguf.kernel,
        )
