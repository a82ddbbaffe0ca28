"""A GGUF file read where it lies: its header's index of tensors, and each tensor as a view of
the memory-mapped file (no copy), as llama.cpp reads it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from loomllm.workers.kernels.gguf_types import KERNEL_TYPES, type_name

# GGUF's float types, which are dense: (name, dtype). The quantized types the kernels do not
# compute with are read for dequantizing only (gguf's own dequantizer).
FLOAT_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}


class UnsupportedTensorType(ValueError):
    """A tensor stored in a type loomllm cannot read, or cannot compute with as stored."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # as torch orders it: the fastest-moving dimension last
    offset: int  # from the file's start


# GGUF metadata value types: the byte size of each fixed-size one; 8 is a string, 9 an array.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GgufFile:
    """The tensors of a GGUF file by their GGUF names (`blk.0.attn_q.weight`); `tensor()`
    gives one as a view of the file's pages, which the kernel's page cache shares between
    every process that maps the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            # A private mapping: writable views for torch, while no byte of it is ever
            # written, so every page stays the file's page in the page cache.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.architecture, self.tensors = _parse_index(self.path, self._map)

    def tensor(self, name: str) -> torch.Tensor:
        """A quantized tensor as uint8 [rows, bytes a row] (its blocks as they are stored); a
        float one as [rows, columns] of its dtype. Neither is a copy."""
        info = self.tensors[name]
        rows = 1
        for size in info.shape[:-1]:
            rows *= size
        columns = info.shape[-1]
        if info.type_id in FLOAT_TYPES:
            dtype = FLOAT_TYPES[info.type_id][1]
            flat = torch.frombuffer(
                self._map, dtype=dtype, count=rows * columns, offset=info.offset
            )
            return flat.view(rows, columns)
        block = _block_size(info.type_id)
        if block is not None:
            weights, block_bytes = block
            if columns % weights:
                raise UnsupportedTensorType(
                    f"{self.path.name}: {name} has rows of {columns}, not whole blocks of {weights}"
                )
            row_bytes = columns // weights * block_bytes
            flat = torch.frombuffer(
                self._map, dtype=torch.uint8, count=rows * row_bytes, offset=info.offset
            )
            return flat.view(rows, row_bytes)
        raise UnsupportedTensorType(
            f"{self.path.name}: {name} is {type_name(info.type_id)}, a type loomllm cannot read"
        )

    def release(self, name: str) -> None:
        """Let the pages of tensor `name` leave this process's memory (they stay the page
        cache's): for a tensor read once, into a layout of loomllm's own. A view of them read
        later reads them from the file again."""
        info = self.tensors[name]
        view = self.tensor(name)
        end = info.offset + view.numel() * view.element_size()
        # Whole pages inside the tensor only: its neighbours' may be in use.
        first = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


def _block_size(type_id: int) -> tuple[int, int] | None:
    """(weights, bytes) a block of a quantized type, from gguf's table; None if unknown."""
    if type_id in KERNEL_TYPES:
        return KERNEL_TYPES[type_id][1:]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def _parse_index(path: Path, buf: mmap.mmap) -> tuple[str, dict[str, TensorInfo]]:
    """(general.architecture, the tensors), read from the header alone. gguf's own reader
    parses every metadata value into objects, a tokenizer's vocabulary included: seconds a
    load, where this skips them."""
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
    found = []
    for _ in range(num_tensors):
        name = string()
        (num_dims,) = struct.unpack_from("<I", buf, at)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, at + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * num_dims)
        at += 4 + 8 * num_dims + 12
        found.append((name, type_id, tuple(reversed(dims)), offset))
    data_start = (at + alignment - 1) // alignment * alignment
    tensors = {
        name: TensorInfo(name, type_id, shape, data_start + offset)
        for name, type_id, shape, offset in found
    }
    return architecture, tensors
