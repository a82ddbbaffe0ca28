"""Random-weight Llama checkpoints at real shapes, in HF format, for llama.cpp's converter
(benchmarks/bench_models.py runs this as a child: `python -m loomllm.benchmarks.random_llama
SHAPE FOLDER`). Written one shard at a time, so an 8B model never sits whole in memory.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

STD = 0.02  # of the random weights; norm weights are 1


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama model's dimensions, as its config.json gives them."""

    title: str  # general.name in the GGUF
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    rope_scaling: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SHAPES = {
    "smollm2-1.7b": Shape(
        title="SmolLM2-1.7B shape, random weights",
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=130000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    # Llama-3.1-8B but for the vocabulary: SmolLM2's, so both shapes share one tokenizer.
    "llama-8b": Shape(
        title="Llama-3.1-8B shape, random weights",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=49152,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
}


def hf_config(shape: Shape, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of a LlamaForCausalLM of this shape, as a checkpoint on the hub has it."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": shape.head_dim,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16",
        "initializer_range": STD,
    }
    for field in Shape.__dataclass_fields__:
        if field != "title" and (value := getattr(shape, field)) is not None:
            config[field] = value
    return config


def tensor_shards(shape: Shape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The model's tensors (name, [out, in] dims) in shards: the embedding, final norm and
    lm_head first, then one shard a layer."""
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    first = [("model.embed_tokens.weight", (shape.vocab_size, h)), ("model.norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        first.append(("lm_head.weight", (shape.vocab_size, h)))
    shards = [first]
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        shards.append(
            [
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.mlp.gate_proj.weight", (shape.intermediate_size, h)),
                (f"{p}.mlp.up_proj.weight", (shape.intermediate_size, h)),
                (f"{p}.mlp.down_proj.weight", (h, shape.intermediate_size)),
            ]
        )
    return shards


def num_parameters(shape: Shape) -> int:
    return sum(math.prod(dims) for shard in tensor_shards(shape) for _, dims in shard)


def write_random_weights(shape: Shape, folder: Path, seed: int) -> None:
    """bf16 safetensors shards of random weights plus their index, one shard in memory at a
    time; each shard draws from its own seeded generator, so the weights are the same however
    the run is split."""
    import torch
    from safetensors.torch import save_file

    shards = tensor_shards(shape)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        generator = torch.Generator().manual_seed(seed * 100_003 + k)
        tensors = {}
        for name, dims in shard:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(dims, generator=generator) * STD).bfloat16()
        filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, folder / filename, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_smollm2_tokenizer(folder: Path) -> tuple[int, int]:
    """SmolLM2-135M's tokenizer, from the embedded GGUF, saved into `folder`; its (bos, eos)."""
    from transformers import AutoTokenizer

    from loomllm.workers.models.sources import resolve_model

    gguf = Path(resolve_model("smollm2").path)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    return tokenizer.bos_token_id, tokenizer.eos_token_id


def write_hf_folder(key: str, folder: Path, seed: int) -> None:
    """What the converter reads for the shape `key`: config.json, SmolLM2's tokenizer and
    random safetensors, marked complete last."""
    folder.mkdir(parents=True)
    bos, eos = save_smollm2_tokenizer(folder)
    shape = SHAPES[key]
    (folder / "config.json").write_text(json.dumps(hf_config(shape, bos, eos), indent=2))
    write_random_weights(shape, folder, seed)
    (folder / ".weights-written").touch()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("folder", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write_hf_folder(args.shape, args.folder, args.seed)


if __name__ == "__main__":
    main()
