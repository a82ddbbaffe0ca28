"""Tiny GGUF files written on the fly: a Llama of random blocks in a chosen mix of quant types,
with SmolLM2's tokenizer (copied from the packaged file), which transformers and llama.cpp
read as they read a converted model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from loomllm.workers.models.sources import resolve_model

# The shape: rows whole blocks of 256, so that every type fits every tensor.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 49152

# Where each type's float16 scales (and mins) lie in its block.
HALF_AT = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
    "IQ2_XXS": [0],  # a type loomllm's kernels do not read
}

# Mixes as llama-quantize writes them, by tensor: (most tensors, attn_v and ffn_down, the
# embedding, the output). The last one spreads the types the others leave out.
MIXES: dict[str, tuple[str, str, str, str]] = {
    "Q4_K_M": ("Q4_K", "Q6_K", "Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q5_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K", "Q6_K", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0", "Q4_0", "Q6_K"),
    "Q3_K_M": ("Q3_K", "Q5_K", "Q3_K", "Q6_K"),
    "rest": ("Q2_K", "IQ4_XS", "IQ4_NL", "Q5_1"),
}
# The types "rest" gives its other tensors, in turn, so that each is run somewhere.
REST_CYCLE = ("Q2_K", "Q4_1", "Q5_0", "IQ4_NL", "IQ4_XS", "Q5_1")


def random_blocks(kind: str, rows: int, columns: int, std: float, rng: np.random.Generator):
    """[rows, bytes a row] of random blocks whose values have about `std`."""
    qtype = GGMLQuantizationType[kind]
    weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, columns // weights, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, size=(len(HALF_AT[kind]), rows, columns // weights))
    # The second float16 of a legacy block is its minimum: negative, as a minimum is.
    signs = [1.0, -1.0 if kind in ("Q4_1", "Q5_1") else 1.0]
    for (at, sign), values in zip(zip(HALF_AT[kind], signs, strict=False), scales, strict=True):
        raw[..., at : at + 2] = (sign * values).astype(np.float16)[..., None].view(np.uint8)
    unit = dequantize(raw.reshape(rows, -1), qtype).std()
    for (at, sign), values in zip(zip(HALF_AT[kind], signs, strict=False), scales, strict=True):
        raw[..., at : at + 2] = (
            (sign * values * std / unit).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(rows, -1)


def make_tiny_gguf(
    path: Path,
    mix: str | tuple[str, str, str, str],
    seed: int = 0,
    architecture: str = "llama",
    rope_factors: np.ndarray | None = None,
) -> Path:
    """A tiny Llama (or Qwen2, with q|k|v biases) of random blocks at `path`, in a mix of
    MIXES or one given as MIXES's are; `rope_factors`: Llama 3's RoPE frequency factors, as
    llama.cpp's converter writes them (`rope_freqs.weight`)."""
    rng = np.random.default_rng(seed)
    main, wide, embedding, output = MIXES[mix] if isinstance(mix, str) else mix
    cycle = iter(REST_CYCLE * 8)
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    _copy_tokenizer(writer)

    def add(name: str, kind: str, rows: int, columns: int, std: float) -> None:
        if mix == "rest" and kind == main:
            kind = next(cycle)
        raw = random_blocks(kind, rows, columns, std, rng)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    def add_floats(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    head_dim = HIDDEN // HEADS
    if rope_factors is not None:
        add_floats("rope_freqs.weight", rope_factors)
    add("token_embd.weight", embedding, VOCAB, HIDDEN, 1.0)
    for i in range(LAYERS):
        add_floats(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        add(f"blk.{i}.attn_q.weight", main, HEADS * head_dim, HIDDEN, 0.03)
        add(f"blk.{i}.attn_k.weight", main, KV_HEADS * head_dim, HIDDEN, 0.03)
        add(f"blk.{i}.attn_v.weight", wide, KV_HEADS * head_dim, HIDDEN, 0.03)
        if architecture == "qwen2":
            add_floats(f"blk.{i}.attn_q.bias", 0.1 * rng.standard_normal(HEADS * head_dim))
            add_floats(f"blk.{i}.attn_k.bias", 0.1 * rng.standard_normal(KV_HEADS * head_dim))
            add_floats(f"blk.{i}.attn_v.bias", 0.1 * rng.standard_normal(KV_HEADS * head_dim))
        add(f"blk.{i}.attn_output.weight", main, HIDDEN, HEADS * head_dim, 0.03)
        add_floats(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        add(f"blk.{i}.ffn_gate.weight", main, INTERMEDIATE, HIDDEN, 0.05)
        add(f"blk.{i}.ffn_up.weight", main, INTERMEDIATE, HIDDEN, 0.05)
        add(f"blk.{i}.ffn_down.weight", wide, HIDDEN, INTERMEDIATE, 0.03)
    add_floats("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    # An output of its own: the embedding's table is then not the LM head (both are read).
    add("output.weight", output, VOCAB, HIDDEN, 0.3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """SmolLM2's tokenizer fields, from the packaged GGUF."""
    reader = GGUFReader(resolve_model("smollm2").path)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub)
