"""GGUF's tensor types by ggml's ids: those loomllm's CPU kernels compute with (the blocks of
cpu_gguf_blocks.h), and every type's name as llama.cpp prints it.
"""

from __future__ import annotations

# The quantized types the kernels read: (name, weights a block, bytes a block).
KERNEL_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}


def type_name(type_id: int) -> str:
    """ggml's name of a type id (as llama.cpp prints it), or `type <id>`."""
    if type_id in KERNEL_TYPES:
        return KERNEL_TYPES[type_id][0]
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def kernel_type_names() -> list[str]:
    """The quantized types loomllm's kernels compute with, by name."""
    return [name for name, _, _ in KERNEL_TYPES.values()]
