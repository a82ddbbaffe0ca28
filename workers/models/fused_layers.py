"""Fused kernels swapped into stock transformers models of the Llama family on the CUDA path.

RMSNorm modules, the rotary function, and layers running q|k|v and gate|up as one matmul each.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from loomllm.workers.kernels import skinny_matmul
from loomllm.workers.kernels.fused_ops import (
    FusedRMSNorm,
    add_rms_norm,
    fused_rotary,
    runs_here,
    silu_mul,
)
from loomllm.workers.models.llama.model import Linear, LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)

# Class names whose forward is transformers' Llama RMSNorm: weight * (x / rms(x)).to(dtype).
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
# Attention classes that call their modeling module's global apply_rotary_pos_emb(q, k,
# cos, sin) with cos and sin as [B, T, D], q and k as [B, heads, T, D]; and the sliding
# window each passes its attention function.
SLIDING_WINDOWS = {
    "LlamaAttention": lambda attn: None,
    "Qwen2Attention": lambda attn: getattr(attn, "sliding_window", None),
    "MistralAttention": lambda attn: getattr(attn.config, "sliding_window", None),
}
# Decoder layers computing norm, attention, add, norm, MLP, add with those modules, and
# MLPs computing down(act(gate(x)) * up(x)).
LLAMA_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"})
LLAMA_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})
SILU = frozenset({"silu", "swish"})


class FusedModel(NamedTuple):
    """What `install_fused_ops` swapped in."""

    norms: int  # RMSNorm modules now running the kernel
    rotary_modules: int  # modeling modules whose rotary function runs it where it fits
    layers: int  # decoder layers with packed projections and fused forwards


class PackedLinear(NamedTuple):
    """Linear layers of one input as one matmul: their weights (and biases) stacked, each
    layer's own now a view of these."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]  # each layer's outputs, in order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def pack_linears(linears: list[torch.nn.Module]) -> PackedLinear | None:
    """Stack plain nn.Linear layers of one input, dtype and device into one (None where they
    are not: quantized or sharded layers keep theirs)."""
    first = linears[0]
    if not all(
        type(m) is torch.nn.Linear
        and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    ):
        return None
    dense = cast("list[torch.nn.Linear]", linears)  # as the check above found them
    with torch.no_grad():
        weight = torch.cat([m.weight for m in dense])
        bias = None if first.bias is None else torch.cat([m.bias for m in dense])
    start = 0
    for m in dense:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return PackedLinear(weight, bias, tuple(m.out_features for m in dense))


# The forwards below are bound onto transformers' modules, whose parts (and the loom_* ones
# fuse_layer adds) are found by name at runtime: `self` is typed Any for that.
def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
):
    """transformers' Llama attention forward with q, k and v from one packed matmul.

    Given a KV cache of transformers' (`generate`; a worker passes none) it hands over to the
    stock forward, which still computes the same: each projection's weight is a packed view."""
    # The cache's keyword differs between transformers versions: `past_key_value` (4),
    # `past_key_values`, `cache` (5.24).
    caches = {
        name: kwargs.pop(name)
        for name in ("past_key_values", "past_key_value", "cache")
        if name in kwargs
    }
    if any(c is not None for c in caches.values()) or position_embeddings is None:
        return type(self).forward(
            self,
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **caches,
            **kwargs,
        )
    input_shape = hidden_states.shape[:-1]
    shape = (*input_shape, -1, self.head_dim)
    packed = self.loom_qkv
    q, k, v = (t.view(shape).transpose(1, 2) for t in packed(hidden_states).split(packed.sizes, -1))
    cos, sin = position_embeddings
    # Call the modeling module's function as transformers does, so the kernel runs where swapped in.
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    window = self.loom_sliding_window
    out, weights = _attention_function(self)(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        **({"sliding_window": window} if window is not None else {}),
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _attention_function(attn: Any) -> Any:
    """The attention function transformers would call for this module's implementation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    implementation = attn.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
    return eager if implementation in (None, "eager") else ALL_ATTENTION_FUNCTIONS[implementation]


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate|up one matmul and the rest one kernel."""
    return self.down_proj(silu_mul(self.loom_gate_up(x)))


def _layer_forward(self: Any, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """transformers' Llama decoder layer with the residual add inside the norm after it."""
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = add_rms_norm(
        hidden_states, residual, norm.weight, norm.variance_epsilon
    )
    return residual + self.mlp(hidden_states)


def fuse_layer(layer: torch.nn.Module) -> bool:
    """Packed projections and fused forwards for one Llama-family decoder layer whose norms
    are FusedRMSNorm already; False where its parts are not what the forwards expect."""
    # A transformers layer: its parts are found by name, and it takes attributes of ours.
    hf_layer: Any = layer
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    if (
        getattr(layer, "loom_fused", False)
        or type(attn).__name__ not in SLIDING_WINDOWS
        or type(mlp).__name__ not in LLAMA_MLPS
        or getattr(attn.config, "hidden_act", None) not in SILU
        or not isinstance(hf_layer.post_attention_layernorm, FusedRMSNorm)
        # _layer_forward returns the hidden states alone, as transformers 5 layers do (4.x:
        # a tuple).
        or inspect.signature(type(layer).forward).return_annotation
        not in (torch.Tensor, "torch.Tensor")
    ):
        return False
    # Packing cuts a decode step's launches, and the small k and v matmuls, which fall short
    # of the memory's bandwidth alone, read their weights inside q's.
    qkv = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = pack_linears([mlp.gate_proj, mlp.up_proj]) if qkv is not None else None
    if gate_up is None:
        return False
    attn.loom_qkv, mlp.loom_gate_up = qkv, gate_up
    attn.loom_sliding_window = SLIDING_WINDOWS[type(attn).__name__](attn)
    attn.forward = types.MethodType(_attention_forward, attn)
    mlp.forward = types.MethodType(_mlp_forward, mlp)
    layer.forward = types.MethodType(_layer_forward, layer)
    hf_layer.loom_fused = True
    return True


def install_fused_ops(model: torch.nn.Module) -> FusedModel:
    """Swap the fused kernels into `model`: RMSNorm modules, the rotary function, then the
    decoder layers. A model of another dtype than bf16 and float32, or on the CPU outside
    Triton's interpreter, keeps its ops. Call it last, once the model has its device,
    dtype and weights: packing copies q|k|v and gate|up into new tensors, which a later
    conversion would leave behind. On CUDA, loomllm's own model also times skinny_matmul
    against cuBLAS on each of its weight shapes, and takes the faster for steps of a few rows.

    The rotary swap is global to that modeling module in this process: every model of that
    architecture here runs it afterwards (a worker holds one model; in `loom bench
    gpu-check` and `decode-profile` and the tests this is by design, and the tests undo it).
    The original stays as the function's `__wrapped__`."""
    if not runs_here(next(model.parameters())):
        return FusedModel(0, 0, 0)
    if isinstance(model, LlamaFamilyForCausalLM):  # loomllm's own: the kernels are built in
        norms, layers = model.use_fused_kernels()
        logger.info("fused kernels: %d RMSNorm modules, %d decoder layers", norms, layers)
        if next(model.parameters()).is_cuda:  # timed on this device (not in the interpreter)
            skinny_matmul.pick(m for m in model.modules() if isinstance(m, Linear))
            torch.cuda.empty_cache()  # the timing graphs' memory, for the KV cache
        return FusedModel(norms, 1, layers)
    norm_names = [name for name, m in model.named_modules() if type(m).__name__ in LLAMA_NORMS]
    for name in norm_names:
        old: Any = model.get_submodule(name)  # transformers' RMSNorm: weight, variance_epsilon
        model.set_submodule(name, FusedRMSNorm(old.weight, old.variance_epsilon))
    modeling = {type(m).__module__ for m in model.modules() if type(m).__name__ in SLIDING_WINDOWS}
    for module_name in modeling:
        module: Any = sys.modules[module_name]  # a modeling module: its functions by name
        if not getattr(module.apply_rotary_pos_emb, "loom_fused", False):
            module.apply_rotary_pos_emb = fused_rotary(module.apply_rotary_pos_emb)
    layers = sum(fuse_layer(m) for m in list(model.modules()) if type(m).__name__ in LLAMA_LAYERS)
    if layers and next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the unpacked weights' memory, for the KV cache
    logger.info(
        "fused kernels: %d RMSNorm modules, rotary embedding in %s, %d decoder layers",
        len(norm_names),
        ", ".join(sorted(modeling)) or "no module",
        layers,
    )
    return FusedModel(len(norm_names), len(modeling), layers)
