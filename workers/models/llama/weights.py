"""The model of llama/model.py built on a device: its weights from a safetensors checkpoint
(q|k|v and gate|up packed as they are copied) or drawn at random ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from loomllm.workers.models.llama.config import DecoderShape, inverse_frequencies
from loomllm.workers.models.llama.model import LlamaFamilyForCausalLM, RMSNorm

# Checkpoint tensors that are packed here: (our parameter, which part of it).
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def build(
    shape: DecoderShape, dtype: torch.dtype, device: torch.device, model_dir: Path, load_format: str
) -> LlamaFamilyForCausalLM:
    """The model on `device` in `dtype`: its weights read from model_dir's safetensors, or
    random ("dummy", drawn as transformers initializes them, on the device)."""
    # Uninitialized tensors, made where they run in the dtype they run in: every one is
    # filled below. (Not on the meta device, because moving from it imports sympy, a slow import.)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaFamilyForCausalLM(shape)
    finally:
        torch.set_default_dtype(default_dtype)
    model.inv_freq = inverse_frequencies(shape).to(device)
    model.tie_weights()
    model.requires_grad_(False)
    if load_format == "dummy":
        _init_randomly(model, shape.initializer_range)
    else:
        load_weights(model, model_dir)
    return model.eval()


def _init_randomly(model: LlamaFamilyForCausalLM, std: float) -> None:
    for name, param in model.named_parameters():
        if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), RMSNorm):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, as transformers finds them: model.safetensors,
    or the shards its index names (other .safetensors files, such as an adapter's or
    Mistral's consolidated one, are not the checkpoint); empty where there is none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def load_weights(model: LlamaFamilyForCausalLM, model_dir: Path) -> None:
    """Copy the checkpoint's tensors in `model_dir` into `model` (see `copy_weights`)."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir} holds no safetensors checkpoint")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as checkpoint:
                for key in checkpoint.keys():  # noqa: SIM118 (safe_open is no mapping)
                    yield key, checkpoint.get_tensor(key)

    copy_weights(model, tensors(), str(model_dir))


def copy_weights(
    model: LlamaFamilyForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    where: str = "the weights",
) -> None:
    """Copy (name, tensor) pairs named as in a transformers checkpoint (or state dict) into
    `model`, packing q|k|v and gate|up. ValueError naming the tensor on a name this model
    lacks, a shape that differs, or one missing from `tensors`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shape = model.shape
    part_sizes = {
        "qkv_proj": (shape.q_size, shape.kv_size, shape.kv_size),
        "gate_up_proj": (shape.intermediate_size,) * 2,
    }
    unfilled = {name: set(range(len(part_sizes.get(name.split(".")[-2], (0,))))) for name in params}
    if shape.tie_word_embeddings:
        unfilled.pop("lm_head.weight")
    seen: set[str] = set()
    for key, tensor in tensors:
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old checkpoints saved: computed here
        if key == "lm_head.weight" and shape.tie_word_embeddings:
            continue  # the embedding, saved twice
        if key in seen:
            raise ValueError(f"checkpoint tensor {key!r} is there twice")
        seen.add(key)
        name, part = _packed_name(key)
        target: torch.Tensor | None = params.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {key!r} has no place in this {shape.architecture}")
        if part is not None:
            sizes = part_sizes[name.split(".")[-2]]
            start = sum(sizes[:part])
            target = target[start : start + sizes[part]]
        if tensor.shape != target.shape:
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
        unfilled[name].discard(part or 0)
    missing = [name for name, parts in unfilled.items() if parts]
    if missing:
        raise ValueError(
            f"{where} lack {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )


def _packed_name(key: str) -> tuple[str, int | None]:
    """Our parameter for a checkpoint tensor, and its part where packed."""
    *path, module, leaf = key.split(".")
    packed = _PACKED.get(module)
    if packed is None:
        return key, None
    return ".".join([*path, packed[0], leaf]), packed[1]
