"""Quantized linear layers on the CPU: torch's weight-only packed int4 (groups of 32 along the
input, with a scale and a zero each) and int8 (one scale per output channel) kernels, and
loomllm's block kernel, which also quantizes the activations (cpu_block_linear.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GROUP_SIZE = 32
# The int4 kernel dequantizes a code q as (q - 8) * scale + zero: zero is w at q == 8.
INT4_MIDPOINT = 8
# Output blocks of 16 columns that the block kernel computes together (its COLUMN_BLOCKS).
TILE_BLOCKS = 3


@dataclass(frozen=True)
class GroupwiseInt4:
    """A weight [N, K] as 4-bit codes in groups of GROUP_SIZE along K:
    w = (q - 8) * scale + zero, which holds GGUF's Q4_0, Q4_1 and Q4_K blocks exactly."""

    codes: torch.Tensor  # [N, K] int32 in [0, 15]
    scale: torch.Tensor  # [N, K // GROUP_SIZE] float32
    zero: torch.Tensor  # [N, K // GROUP_SIZE] float32

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - INT4_MIDPOINT
        return (codes * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> GroupwiseInt4:
        """The weight with its rows reordered (or picked) by `index`."""
        return GroupwiseInt4(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list[GroupwiseInt4]) -> GroupwiseInt4:
        """Weights stacked along N, as q|k|v and gate|up are packed."""
        return GroupwiseInt4(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )

    @staticmethod
    def from_dense(weight: torch.Tensor) -> GroupwiseInt4:
        """Round-to-nearest asymmetric int4 of a float weight [N, K], each group's range
        mapped onto the 16 codes (quantization on load)."""
        n, k = weight.shape
        groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        # Each group's scale and minimum are float16 values where float16 holds them (as
        # GGUF's Q4_1), so that the block kernel streams them in 2 bytes; the codes are taken
        # against them. A constant group keeps scale 1 (as one too small for float16): its
        # codes are all 0 and zero carries the value.
        scale = _in_half_where_finite((high - low) / 15)
        scale = torch.where((high > low) & (scale > 0), scale, torch.ones_like(low))
        low = _in_half_where_finite(low)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        zero = low + INT4_MIDPOINT * scale
        return GroupwiseInt4(codes.to(torch.int32).view(n, k), scale, zero)


def _in_half_where_finite(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to float16's, those beyond its range kept as they are."""
    half = values.half().float()
    return torch.where(half.isfinite(), half, values)


@dataclass(frozen=True)
class CodeBlocks:
    """A weight [N, K] as unsigned codes in blocks of GROUP_SIZE along K, w = code * a + b
    in each block: GGUF's 4-bit and Q8_0 blocks hold exactly."""

    codes: torch.Tensor  # [N, K] uint8: below 16 for 4 bits
    a: torch.Tensor  # [N, K // GROUP_SIZE] float32
    b: torch.Tensor  # [N, K // GROUP_SIZE] float32
    bits: int  # 4 or 8

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32."""
        n, k = self.codes.shape
        codes = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (codes * self.a[..., None] + self.b[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[CodeBlocks]) -> CodeBlocks:
        """Weights stacked along N, as q|k|v and gate|up are packed: 8 bits if any part is."""
        return CodeBlocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.a for p in parts]),
            torch.cat([p.b for p in parts]),
            max(p.bits for p in parts),
        )

    @staticmethod
    def from_int4(weight: GroupwiseInt4) -> CodeBlocks:
        return CodeBlocks(
            weight.codes.to(torch.uint8),
            weight.scale.float(),
            (weight.zero - INT4_MIDPOINT * weight.scale).float(),
            4,
        )

    @staticmethod
    def from_int8(codes: torch.Tensor, scale: torch.Tensor) -> CodeBlocks:
        """Signed codes [N, K] with a scale for each block [N, K // GROUP_SIZE] (Q8_0)."""
        scale = scale.float()
        return CodeBlocks((codes.to(torch.int16) + 128).to(torch.uint8), scale, -128 * scale, 8)


def fits_int4(in_features: int, out_features: int) -> bool:
    """Whether torch's CPU int4 pack takes a weight of this shape."""
    return in_features % GROUP_SIZE == 0 and out_features % 16 == 0


def fits_int8(in_features: int) -> bool:
    """Whether torch's CPU int8 kernel takes this input width: its bfloat16 path crashes on
    rows that are not whole vectors (seen at 72 columns), so whole groups only."""
    return in_features % GROUP_SIZE == 0


def int4_values(weight: GroupwiseInt4, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] as Int4Linear in `dtype` computes with: its scales and zeros are
    held in that dtype."""
    scale, zero = weight.scale.to(dtype).float(), weight.zero.to(dtype).float()
    return GroupwiseInt4(weight.codes, scale, zero).dequantize()


class Int4Linear:
    """x @ w.T with w packed as torch's CPU int4 kernel reads it (computed in x's dtype)."""

    def __init__(self, weight: GroupwiseInt4, dtype: torch.dtype) -> None:
        self.out_features = weight.codes.shape[0]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.contiguous(), 1)
        # [K // GROUP_SIZE, N, 2]: each group's (scale, zero), as the kernel reads them.
        scale_zero = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
        self.scale_zero = scale_zero.contiguous().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Contiguous rows: the kernel refuses others.
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scale_zero)
        return out.view(*x.shape[:-1], self.out_features)


class Int8Linear:
    """x @ w.T with w as int8 codes and one scale per output channel (symmetric)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        weight = weight.float()
        self.out_features = weight.shape[0]
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] this layer computes with, in float32."""
        return self.codes.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Contiguous rows: the bfloat16 kernel reads past strided rows (a crash).
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch._weight_int8pack_mm(rows, self.codes, self.scale)
        return out.view(*x.shape[:-1], self.out_features)


def _in_tiles(per_block: torch.Tensor) -> torch.Tensor:
    """[N / 16, K / 32, ...] in the block kernel's order, same shape: column blocks in tiles
    of TILE_BLOCKS (the last may be narrower), each tile's groups in turn, with the tile's
    blocks one after another in each."""
    blocks = per_block.shape[0]
    whole = blocks - blocks % TILE_BLOCKS
    tiles = per_block[:whole].unflatten(0, (-1, TILE_BLOCKS)).transpose(1, 2)
    rest = per_block[whole:].transpose(0, 1)
    return torch.cat([tiles.reshape(-1), rest.reshape(-1)]).view(per_block.shape)


class BlockLinear:
    """x @ w.T on loomllm's block kernel (the C++ ops' block_linear): w as its blocks, and x
    quantized to int8 in blocks of 32 as it comes in, as llama.cpp computes with Q8_1."""

    def __init__(self, weight: CodeBlocks, ops: Any) -> None:
        n, k = weight.codes.shape
        blocks, groups = n // 16, k // GROUP_SIZE
        self.out_features, self.bits, self.ops = n, weight.bits, ops
        # [N / 16, K / 32, 8 quads of 4 inputs, 16 lanes, 4]: each vector lane an output.
        quads = weight.codes.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)
        if weight.bits == 4:  # quads 2p and 2p + 1 share bytes: the low and high nibbles
            quads = quads[:, :, 0::2] | (quads[:, :, 1::2] << 4)
        self.packed = _in_tiles(quads.reshape(blocks, groups, -1))
        # Each block's a and b; a alone where b = -2^(bits - 1) * a (Q4_0, Q8_0); in float16
        # where that holds them exactly (GGUF's scales): fewer bytes to stream at one row.
        a, b = weight.a.float(), weight.b.float()
        parts = [a] if torch.equal(b, -(2 ** (weight.bits - 1)) * a) else [a, b]
        exact_in_half = all(torch.equal(t.half().float(), t) for t in parts)
        per_lane = [t.view(blocks, 16, groups).transpose(1, 2) for t in parts]
        scales = torch.stack(per_lane, dim=2)  # [N / 16, K / 32, 1 or 2, 16]
        self.scales = _in_tiles(scales.half() if exact_in_half else scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.ops.block_linear(rows, self.packed, self.scales, None, self.bits, False)
        return out.view(*x.shape[:-1], self.out_features)
