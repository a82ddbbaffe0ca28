"""The model of llama/model.py built over a GGUF file's tensors as they lie: linear layers and
the embedding compute from the file's blocks, and only the norms and biases are copied.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from loomllm.workers.kernels.gguf_linear import (
    REPACKED_TYPES,
    DenseEmbedding,
    GgufEmbedding,
    GgufLinear,
    GgufPart,
    RepackedLinear,
    in_transformers_order,
)
from loomllm.workers.kernels.gguf_types import KERNEL_TYPES, kernel_type_names, type_name
from loomllm.workers.models.gguf_file import FLOAT_TYPES, GgufFile, UnsupportedTensorType
from loomllm.workers.models.llama.config import DecoderShape, inverse_frequencies
from loomllm.workers.models.llama.model import Linear, LlamaFamilyForCausalLM, RMSNorm

logger = logging.getLogger(__name__)

# llama.cpp's converter interleaves the rotary halves of q's and k's rows for these
# architectures (transformers undoes it for "llama" alone, and so do we).
PERMUTED_ARCHITECTURES = ("llama",)

_LAYER_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _layer_linears(shape: DecoderShape) -> dict[str, tuple[tuple[str, int], ...]]:
    """Our packed linear layers, and the GGUF tensors each stacks with their output rows."""
    kv = shape.kv_size
    return {
        "self_attn.qkv_proj": (("attn_q", shape.q_size), ("attn_k", kv), ("attn_v", kv)),
        "self_attn.o_proj": (("attn_output", shape.hidden_size),),
        "mlp.gate_up_proj": (
            ("ffn_gate", shape.intermediate_size),
            ("ffn_up", shape.intermediate_size),
        ),
        "mlp.down_proj": (("ffn_down", shape.hidden_size),),
    }


class _Reader:
    """The file's tensors for one build, checked against the config's shapes, and, with
    `check_kernels`, against the types loomllm's kernels read."""

    def __init__(self, gguf: GgufFile, dtype: torch.dtype, ops: Any, check_kernels: bool) -> None:
        self.gguf, self.dtype, self.ops, self.check_kernels = gguf, dtype, ops, check_kernels
        self.dense_layers = self.repacked_layers = 0
        # Q4_0, Q4_1 and Q8_0 layers run on the a8 kernel's panels where it has its vector
        # path (AVX512-VNNI): blocks of 32 with a float16 scale each cost more to stream as
        # stored than the same bytes laid out for it.
        has_vnni = getattr(ops, "block_linear_has_vnni", None)
        self.repack = check_kernels and has_vnni is not None and has_vnni()

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.gguf.path.name} has no tensor {name}")
        if tuple(info.shape) != shape:
            raise ValueError(
                f"{self.gguf.path.name}: {name} has shape {info.shape}, the config's {shape}"
            )
        if self.check_kernels and info.type_id not in (*KERNEL_TYPES, *FLOAT_TYPES):
            raise UnsupportedTensorType(
                f"{self.gguf.path.name}: {name} is stored as {type_name(info.type_id)}, which "
                f"loomllm's kernels do not compute with (they do "
                f"{', '.join(kernel_type_names())}); quantization='none' dequantizes the file "
                "to float weights instead"
            )
        return self.gguf.tensor(name)

    def linear(
        self, names: list[str], rows: list[int], heads: list[int], in_features: int, bias: bool
    ) -> torch.nn.Module:
        """A linear layer over these tensors, stacked along the output."""
        tensors = [
            self.tensor(f"{name}.weight", (n, in_features))
            for name, n in zip(names, rows, strict=True)
        ]
        biases = None
        if bias:
            biases = torch.cat(
                [
                    in_transformers_order(self.tensor(f"{name}.bias", (n,))[0], h)
                    for name, n, h in zip(names, rows, heads, strict=True)
                ]
            ).to(self.dtype)
        types = [self.gguf.tensors[f"{name}.weight"].type_id for name in names]
        if any(t in FLOAT_TYPES for t in types):
            # Stored dense already: converted to the model's dtype (the same bytes, or fewer).
            self.dense_layers += 1
            linear = Linear(in_features, sum(rows), bias=bias, device="meta")
            weights = [
                in_transformers_order(t, h).to(self.dtype)
                for t, h in zip(tensors, heads, strict=True)
            ]
            linear.weight = torch.nn.Parameter(torch.cat(weights), requires_grad=False)
            if biases is not None:
                linear.bias = torch.nn.Parameter(biases, requires_grad=False)
            return linear
        parts = [GgufPart(t, k, h) for t, k, h in zip(tensors, types, heads, strict=True)]
        if self.repack and all(t in REPACKED_TYPES for t in types):
            self.repacked_layers += 1
            layer = RepackedLinear(in_features, parts, biases, self.ops)
            for name in names:  # read once: its pages may leave this process's memory
                self.gguf.release(f"{name}.weight")
            return layer
        return GgufLinear(in_features, parts, biases, self.ops)

    def norm(self, norm: RMSNorm, name: str) -> None:
        weight = self.tensor(f"{name}.weight", (norm.weight.shape[0],))[0]
        norm.weight = torch.nn.Parameter(weight.to(self.dtype).clone(), requires_grad=False)


def build(
    shape: DecoderShape, dtype: torch.dtype, gguf: GgufFile, ops: Any, check_kernels: bool
) -> LlamaFamilyForCausalLM:
    """The model in `dtype` on the CPU, its linear layers and embedding over `gguf`'s blocks
    (`ops`: what computes from them, or dequantizes them). ValueError naming the tensor
    where the file lacks one or holds one of another shape; with `check_kernels`,
    UnsupportedTensorType where it stores one in a type loomllm's kernels do not read."""
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(shape)
    model.requires_grad_(False)
    read = _Reader(gguf, dtype, ops, check_kernels)
    permuted = gguf.architecture in PERMUTED_ARCHITECTURES
    heads = {"attn_q": shape.num_attention_heads, "attn_k": shape.num_key_value_heads}
    for i, layer in enumerate(model.model.layers):
        for module_name, parts in _layer_linears(shape).items():
            old = cast(Linear, layer.get_submodule(module_name))  # as the model built it
            new = read.linear(
                [f"blk.{i}.{part}" for part, _ in parts],
                [rows for _, rows in parts],
                [heads.get(part, 0) if permuted else 0 for part, _ in parts],
                old.in_features,
                old.bias is not None,
            )
            replace_module(layer, module_name, new)
        for module_name, gguf_name in _LAYER_NORMS.items():
            if _has_submodule(layer, module_name):
                norm = cast(RMSNorm, layer.get_submodule(module_name))
                read.norm(norm, f"blk.{i}.{gguf_name}")
    read.norm(model.model.norm, "output_norm")
    table = read.tensor("token_embd.weight", (shape.vocab_size, shape.hidden_size))
    type_id = gguf.tensors["token_embd.weight"].type_id
    # Put by name, as the layers' linear layers above: the model's class declares the dense
    # modules these replace.
    embedding: torch.nn.Module
    if type_id in FLOAT_TYPES:
        embedding = DenseEmbedding(table, dtype)
    else:
        embedding = GgufEmbedding(GgufPart(table, type_id), shape.hidden_size, dtype, ops)
    replace_module(model, "model.embed_tokens", embedding)
    # A file without `output` ties the LM head to the embedding, as llama.cpp reads it.
    head = "output" if "output.weight" in gguf.tensors else "token_embd"
    lm_head = read.linear([head], [shape.vocab_size], [0], shape.hidden_size, False)
    replace_module(model, "lm_head", lm_head)
    model.inv_freq = inverse_frequencies(shape)
    if "rope_freqs.weight" in gguf.tensors:
        # Llama 3's scaled RoPE, as llama.cpp's converter stores it (transformers' config
        # from a GGUF drops it): each frequency divided by its factor.
        model.inv_freq = (
            model.inv_freq / read.tensor("rope_freqs.weight", (shape.head_dim // 2,))[0]
        )
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"not filled from the GGUF file: {left}"
    if read.dense_layers:
        logger.info("%d linear layers stored in float types run dense", read.dense_layers)
    if read.repacked_layers:
        logger.info(
            "%d linear layers of Q4_0, Q4_1 or Q8_0 blocks repacked for the a8 kernel",
            read.repacked_layers,
        )
    return model.eval()


def replace_module(parent: torch.nn.Module, path: str, new: torch.nn.Module) -> None:
    """Put `new` at `path` (dotted) under `parent`."""
    owner, _, name = path.rpartition(".")
    setattr(parent.get_submodule(owner) if owner else parent, name, new)


def _has_submodule(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
