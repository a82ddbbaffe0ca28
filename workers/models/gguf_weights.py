"""A GGUF file's quantized tensors as they are stored (4-bit blocks as groupwise int4; 4-bit and
Q8_0 blocks as codes with scales and offsets), named as checkpoint tensors
(`model.layers.0.self_attn.q_proj.weight`), rows in the checkpoint's order.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loomllm.workers.kernels.cpu_linear import (
    GROUP_SIZE,
    INT4_MIDPOINT,
    CodeBlocks,
    GroupwiseInt4,
)

# GGUF tensor names of one decoder layer, and the checkpoint's.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output": "lm_head"}
# llama.cpp's converter interleaves the rotary halves of q and k rows for these; transformers
# reverses it when it reads them, and so do we.
_PERMUTED_ARCHITECTURES = ("llama",)


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
BLOCK_TYPES = (*INT4_TYPES, "Q8_0")  # the types `blocks()` reads
_Q8_0_BYTES = 34  # a float16 scale, then 32 int8 codes


@dataclass(frozen=True)
class StoredWeight:
    """How a tensor is stored: its GGUF type name and its bytes (read from the file when
    `int4()` decodes them)."""

    gguf_type: str  # "Q4_1", "Q8_0", "F32", ...
    raw: np.ndarray  # [out_features, bytes a row], a view of the memory-mapped file
    unpermute_heads: int | None = None  # llama's q and k: rows to put back in HF's order

    @property
    def is_int4(self) -> bool:
        return self.gguf_type in INT4_TYPES

    def int4(self) -> GroupwiseInt4:
        groups = _int4_groups(self.gguf_type, self.raw)
        assert groups is not None, f"{self.gguf_type} is no 4-bit type"
        if self.unpermute_heads is not None:
            groups = groups.rows(_unpermute_rows(self.raw.shape[0], self.unpermute_heads))
        return groups

    def blocks(self) -> CodeBlocks:
        """The 4-bit or Q8_0 blocks as codes with their scales and offsets, exactly."""
        if self.is_int4:
            return CodeBlocks.from_int4(self.int4())
        assert self.gguf_type == "Q8_0", f"{self.gguf_type} is none of {BLOCK_TYPES}"
        n = self.raw.shape[0]
        blocks = self.raw.reshape(n, -1, _Q8_0_BYTES)
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1))
        weight = CodeBlocks.from_int8(codes, _f16(blocks, 0))
        if self.unpermute_heads is None:
            return weight
        rows = _unpermute_rows(n, self.unpermute_heads)
        return CodeBlocks(weight.codes[rows], weight.a[rows], weight.b[rows], weight.bits)


def read_stored_weights(
    path: Path, num_heads: int, num_kv_heads: int
) -> tuple[str, dict[str, StoredWeight]]:
    """(the file's architecture, each 2-D tensor's storage by checkpoint name)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    architecture, tensors, data_start = _read_index(path)
    permuted = architecture in _PERMUTED_ARCHITECTURES
    data = np.memmap(path, dtype=np.uint8, mode="r")
    stored: dict[str, StoredWeight] = {}
    for gguf_name, (type_id, dims, offset) in tensors.items():
        name = _checkpoint_name(gguf_name)
        if name is None or len(dims) != 2:
            continue
        try:
            kind = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            continue  # a type this gguf does not know: the layer stays dense
        in_features, out_features = dims  # GGUF lists the fastest-moving dimension first
        row_bytes = in_features // block * block_bytes
        start = data_start + offset
        raw = data[start : start + out_features * row_bytes].reshape(out_features, row_bytes)
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = num_heads
        elif permuted and name.endswith("k_proj.weight"):
            heads = num_kv_heads
        stored[name] = StoredWeight(kind.name, raw, heads)
    return architecture, stored


# GGUF metadata value types: the byte size of each fixed-size one; 8 is a string, 9 an array.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _read_index(path: Path) -> tuple[str, dict[str, tuple[int, tuple[int, ...], int]], int]:
    """(general.architecture, {tensor name: (type id, dims, data offset)}, where data starts),
    read from the header alone. gguf's own reader parses every metadata value into objects,
    a tokenizer's vocabulary included: seconds a load, where this skips them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return _parse_index(path, mapped)


def _parse_index(
    path: Path, buf: mmap.mmap
) -> tuple[str, dict[str, tuple[int, tuple[int, ...], int]], int]:
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):  # a big-endian file reads as a huge version
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    at = 24
    architecture, alignment = "", 32

    def string() -> str:
        nonlocal at
        (size,) = struct.unpack_from("<Q", buf, at)
        text = buf[at + 8 : at + 8 + size].decode()
        at += 8 + size
        return text

    def skip(value_type: int) -> None:
        nonlocal at
        if value_type == _STRING:
            (size,) = struct.unpack_from("<Q", buf, at)
            at += 8 + size
        elif value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item_type in _VALUE_SIZES:
                at += count * _VALUE_SIZES[item_type]
            else:
                for _ in range(count):
                    skip(item_type)
        else:
            at += _VALUE_SIZES[value_type]

    for _ in range(num_fields):
        key = string()
        (value_type,) = struct.unpack_from("<I", buf, at)
        at += 4
        if key == "general.architecture" and value_type == _STRING:
            architecture = string()
        elif key == "general.alignment" and value_type == _UINT32:
            (alignment,) = struct.unpack_from("<I", buf, at)
            at += 4
        else:
            skip(value_type)
    tensors = {}
    for _ in range(num_tensors):
        name = string()
        (num_dims,) = struct.unpack_from("<I", buf, at)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, at + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * num_dims)
        at += 4 + 8 * num_dims + 12
        tensors[name] = (type_id, tuple(dims), offset)
    return architecture, tensors, (at + alignment - 1) // alignment * alignment


def _checkpoint_name(gguf_name: str) -> str | None:
    base, _, leaf = gguf_name.rpartition(".")
    if leaf != "weight":
        return None
    if base in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    return None


def _unpermute_rows(out_features: int, heads: int) -> torch.Tensor:
    """The row order transformers' reverse permutation of llama's q or k weights gives."""
    half = out_features // heads // 2
    rows = torch.arange(out_features).view(heads, half, 2)
    return rows.transpose(1, 2).reshape(out_features)


def _f16(raw: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [N, blocks]."""
    return torch.from_numpy(
        raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    )


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 32 codes from 16 bytes: the low nibbles first, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _int4_groups(kind: str, raw: np.ndarray) -> GroupwiseInt4 | None:
    """Q4_0, Q4_1 and Q4_K rows [N, bytes] as groupwise int4; None for other types."""
    n = raw.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(n, -1, size)
        scale = _f16(blocks, 0)
        # Q4_0: w = d * (q - 8); Q4_1: w = d * q + m.
        zero = (
            torch.zeros_like(scale) if kind == "Q4_0" else _f16(blocks, 2) + INT4_MIDPOINT * scale
        )
        codes = _nibbles(blocks[..., size - 16 :])
    elif kind == "Q4_K":
        blocks = raw.reshape(n, -1, 144)  # 256 weights: d, dmin, 12 bytes of scales, 128 of codes
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sub_scales, sub_mins = _k_scales(blocks[..., 4:16])  # [N, blocks, 8] each
        scale = (d[..., None] * sub_scales).reshape(n, -1)
        # w = d * sc * q - dmin * m
        zero = (INT4_MIDPOINT * d[..., None] * sub_scales - dmin[..., None] * sub_mins).reshape(
            n, -1
        )
        chunks = blocks[..., 16:].reshape(n, -1, 4, 32)  # 32 bytes: 2 groups of 32 codes
        codes = np.stack([chunks & 0x0F, chunks >> 4], axis=-2)  # [N, blocks, 4, 2, 32]
    else:
        return None
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(n, -1).astype(np.int32))
    assert codes_t.shape[1] == scale.shape[1] * GROUP_SIZE
    return GroupwiseInt4(codes_t, scale.contiguous(), zero.contiguous())


def _k_scales(packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's eight 6-bit scales and mins a block, from its 12 bytes (ggml's get_scale_min_k4)."""
    q = packed.astype(np.int32)
    low_scales, low_mins = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_scales = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    high_mins = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    scales = np.concatenate([low_scales, high_scales], axis=-1).astype(np.float32)
    mins = np.concatenate([low_mins, high_mins], axis=-1).astype(np.float32)
    return torch.from_numpy(scales), torch.from_numpy(mins)
