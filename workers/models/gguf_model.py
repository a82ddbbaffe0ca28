"""A GGUF file as loomllm's own model runs it: over the file's blocks on the CPU (quantization
"gguf", the default), or dequantized to dense float weights (quantization "none").
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from loomllm.workers.kernels import cpu_native
from loomllm.workers.kernels.gguf_linear import (
    BATCH_INVARIANT,
    DenseEmbedding,
    GgufEmbedding,
    GgufLinear,
)
from loomllm.workers.models import gguf_build
from loomllm.workers.models.gguf_file import GgufFile, UnsupportedTensorType
from loomllm.workers.models.llama.config import DecoderShape
from loomllm.workers.models.llama.model import Embedding, Linear, LlamaFamilyForCausalLM
from loomllm.workers.models.sources import cache_root

logger = logging.getLogger(__name__)

__all__ = ["UnsupportedTensorType", "build"]


def build(
    shape: DecoderShape,
    dtype: torch.dtype,
    device: torch.device,
    path: Path,
    as_stored: bool,
    batch_invariant: bool = False,
) -> LlamaFamilyForCausalLM:
    """The model over `path`'s tensors: computing from their blocks (`as_stored`, on the CPU,
    in float32 or bfloat16; with `batch_invariant`, on one kernel at every batch size), else
    with their values dequantized to `dtype` on `device`."""
    gguf = GgufFile(path)
    ops = None
    if as_stored:
        if dtype not in cpu_native.DTYPES:
            raise ValueError(
                f"a GGUF file runs as stored in float32 or bfloat16, not {dtype}; "
                "quantization='none' dequantizes it"
            )
        ops = cpu_native.load(cache_root())
        if ops is None:
            logger.warning(
                "%s runs dequantized to %s (quantization='none'): loomllm's C++ ops, which "
                "compute from its blocks, are not available (see the log line above)",
                path.name,
                dtype,
            )
            as_stored = False
    model = gguf_build.build(shape, dtype, gguf, ops or NumpyBlocks(), as_stored)
    if batch_invariant:
        for module in model.modules():
            if isinstance(module, GgufLinear):
                module.kernel = BATCH_INVARIANT
    if not as_stored:
        logger.info("%s dequantized to %s on %s (quantization='none')", path.name, dtype, device)
        _dequantize_in_place(model, dtype, device)
    return model


class NumpyBlocks:
    """gguf's own dequantizer in the place of the C++ ops' gguf_dequantize: every quantized
    type gguf reads, where loomllm's kernels are not available or do not read the type."""

    @staticmethod
    def gguf_dequantize(
        data: torch.Tensor, type_id: int, k: int, rows: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = data.numpy() if rows is None else data.numpy()[rows.numpy()]
        values = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(type_id))
        return torch.from_numpy(values.reshape(-1, k)).to(dtype)


def _dequantize_in_place(
    model: LlamaFamilyForCausalLM, dtype: torch.dtype, device: torch.device
) -> None:
    """Every GGUF linear layer and the embedding as dense ones on `device`; an LM head over
    the embedding's blocks shares its dense table, as a tied one does."""
    embedding = model.model.embed_tokens
    if isinstance(embedding, DenseEmbedding):
        table, blocks = embedding.table.to(dtype), embedding.table
    else:
        assert isinstance(embedding, GgufEmbedding)
        part = embedding.part
        table = embedding.ops.gguf_dequantize(
            part.data, part.type_id, embedding.embedding_dim, None, dtype
        )
        blocks = part.data
    dense_table = torch.nn.Parameter(table.to(device), requires_grad=False)
    model.model.embed_tokens = Embedding(
        embedding.num_embeddings, embedding.embedding_dim, device="meta"
    )
    model.model.embed_tokens.weight = dense_table
    for name, module in list(model.named_modules()):
        if not isinstance(module, GgufLinear):
            continue
        dense = Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        if len(module.parts) == 1 and module.parts[0].data.data_ptr() == blocks.data_ptr():
            dense.weight = dense_table
        else:
            weight = module.dequantized(dtype).to(device)
            dense.weight = torch.nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            dense.bias = torch.nn.Parameter(module.bias.to(device), requires_grad=False)
        gguf_build.replace_module(model, name, dense)
    model.to(device)
