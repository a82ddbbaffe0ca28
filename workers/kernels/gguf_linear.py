"""Linear layers and embeddings that compute from a GGUF file's blocks (cpu_gguf_linear.cpp's
gguf_linear and gguf_dequantize), as loomllm's own model runs a GGUF file on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loomllm.workers.kernels.gguf_types import type_name


@dataclass(frozen=True, slots=True)
class GgufPart:
    """One stored tensor of a layer's weight, rows in the file's order: the whole weight, or
    q, k or v of q|k|v, gate or up of gate|up. `heads` > 0: llama.cpp's converter interleaved
    the rotary halves of each of these heads' rows, which the kernel reads back in
    transformers' order."""

    data: torch.Tensor  # uint8 [rows, bytes a row]: the blocks, a view of the mapped file
    type_id: int  # ggml's type id (gguf_types.py's KERNEL_TYPES)
    heads: int = 0

    @property
    def rows(self) -> int:
        return self.data.shape[0]


# gguf_linear's `kernel`: the fastest for each number of rows, or one kernel at every number
# of rows, so that a row's result does not depend on the batch it came in (batch invariance).
FASTEST, BATCH_INVARIANT = 0, 1


class GgufLayer(torch.nn.Module):
    """What a linear layer of a GGUF's blocks holds however it computes: its shape, its parts'
    types and its bias."""

    def __init__(self, in_features: int, parts: list[GgufPart], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.types = [p.type_id for p in parts]
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        kinds = "|".join(type_name(t) for t in self.types)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


class GgufLinear(GgufLayer):
    """x @ w.T + bias with w as the parts' blocks, stacked along the output."""

    kernel = FASTEST

    def __init__(
        self, in_features: int, parts: list[GgufPart], bias: torch.Tensor | None, ops: Any
    ) -> None:
        super().__init__(in_features, parts, bias)
        self.parts = parts
        self.ops = ops
        # The op's arguments, built once: a call then passes them as they are.
        self.tensors = [p.data for p in parts]
        self.heads = [p.heads for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.ops.gguf_linear(
            rows, self.tensors, self.types, self.heads, self.bias, self.kernel
        )
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out_features, in_features] in `dtype` (float paths and tests)."""
        return torch.cat(
            [
                in_transformers_order(
                    self.ops.gguf_dequantize(p.data, p.type_id, self.in_features, None, dtype),
                    p.heads,
                )
                for p in self.parts
            ]
        )


class GgufEmbedding(torch.nn.Module):
    """An embedding table's rows dequantized from its blocks as tokens look them up."""

    def __init__(self, part: GgufPart, embedding_dim: int, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.part = part
        self.num_embeddings, self.embedding_dim = part.rows, embedding_dim
        self.dtype, self.ops = dtype, ops

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.part
        rows = self.ops.gguf_dequantize(
            p.data, p.type_id, self.embedding_dim, ids.reshape(-1), self.dtype
        )
        return rows.view(*ids.shape, self.embedding_dim)


class DenseEmbedding(torch.nn.Module):
    """A float embedding table as the file stores it (F32 as a view, F16 and BF16 rows
    converted as tokens look them up)."""

    def __init__(self, table: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table).to(self.dtype)


def in_transformers_order(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (or a bias's values) in the file's order put in transformers' (GgufPart.heads)."""
    if heads == 0:
        return rows
    n = rows.shape[0]
    order = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return rows[order]


# Legacy types whose blocks the a8 kernel's panels hold in the same bytes (4-bit or 8-bit codes,
# float16 scales): Q4_0, Q4_1, Q8_0.
REPACKED_TYPES = (2, 3, 8)


def legacy_code_blocks(part: GgufPart) -> Any:
    """A Q4_0, Q4_1 or Q8_0 part's blocks as cpu_linear's CodeBlocks (w = code * a + b per 32
    inputs), exactly, rows in transformers' order."""
    from loomllm.workers.kernels.cpu_linear import CodeBlocks

    raw = part.data
    rows = raw.shape[0]
    size = {2: 18, 3: 20, 8: 34}[part.type_id]
    blocks = raw.view(rows, -1, size)

    def half_at(at: int) -> torch.Tensor:  # [rows, blocks] float32
        return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()

    d = half_at(0)
    if part.type_id == 8:  # int8 q, w = d * q
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        weights = CodeBlocks.from_int8(codes, d)
    else:  # nibbles: weight i low, 16 + i high; w = d * q - 8d (Q4_0) or d * q + m (Q4_1)
        qs = blocks[..., size - 16 :]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, -1)
        offset = -8.0 * d if part.type_id == 2 else half_at(2)
        weights = CodeBlocks(codes, d, offset, 4)
    order = in_transformers_order(torch.arange(rows), part.heads)
    return CodeBlocks(weights.codes[order], weights.a[order], weights.b[order], weights.bits)


class RepackedLinear(GgufLayer):
    """A layer of Q4_0, Q4_1 and Q8_0 blocks, repacked once at load into the a8 kernel's panels
    (cpu_linear.BlockLinear): the same bytes, laid out so that one row of x streams them as
    fast as many rows, where the blocks as stored cost a scale's handling per 32 weights."""

    def __init__(
        self, in_features: int, parts: list[GgufPart], bias: torch.Tensor | None, ops: Any
    ) -> None:
        from loomllm.workers.kernels.cpu_linear import BlockLinear, CodeBlocks

        super().__init__(in_features, parts, bias)
        self.a8 = BlockLinear(CodeBlocks.cat([legacy_code_blocks(p) for p in parts]), ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a8(x)
        return out if self.bias is None else out + self.bias
