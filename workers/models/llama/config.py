"""What llama/model.py runs, read from config.json without transformers: the model's shape, or
why it is left to transformers; and RoPE's inverse frequencies, computed as transformers does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
# A config.json with no `architectures` (a config saved alone) names its model_type only.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# Fields every one of the four config classes defaults alike (transformers 4.56 to 5.x), so
# a config.json written without them (save_pretrained drops defaults) means these values.
COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_theta": 10000.0,
}
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What the model is made of, from config.json; field names as in transformers' configs
    (attention/geometry.py's kv_geometry reads them)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for the default RoPE
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each head of q and k before the rotary embedding
    sliding_window: int | None  # Mistral's, on every layer
    initializer_range: float
    dtype: str | None  # what the checkpoint stores ("bfloat16", ...), if it says

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def read_shape(config_path: Path) -> tuple[DecoderShape | None, str]:
    """The model's shape if this module runs it, else None and why not.

    A config it does not fully understand (a RoPE type other than default, linear and llama3,
    Qwen's sliding windows, quantization, a missing field whose default differs between the
    architectures) is declined. It reads the JSON itself because transformers' config classes
    import its modeling code."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable config.json: {exc}"
    architectures = config.get("architectures") or [MODEL_TYPES.get(config.get("model_type"))]
    arch = architectures[0] if len(architectures) == 1 else None
    if arch not in ARCHITECTURES:
        named = config.get("architectures") or f"model_type {config.get('model_type')!r}"
        return None, f"architecture {named} (runs: {', '.join(sorted(ARCHITECTURES))})"
    if "model_type" in config and MODEL_TYPES.get(config["model_type"]) != arch:
        # transformers builds the model_type's class: the two must agree.
        return None, f"model_type {config['model_type']!r} with architectures {architectures}"
    if config.get("quantization_config"):
        return None, "a quantized checkpoint"
    missing = [key for key in REQUIRED if config.get(key) is None]
    if missing:
        return None, f"config.json does not give {', '.join(missing)}"

    def get(key: str) -> Any:
        value = config.get(key)
        return COMMON_DEFAULTS[key] if value is None else value

    if get("hidden_act") not in ("silu", "swish"):
        return None, f"hidden_act {get('hidden_act')!r}"
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is None and arch != "LlamaForCausalLM":  # their classes default it otherwise
        return None, "config.json does not give num_key_value_heads"
    head_dim = config.get("head_dim")
    if head_dim is None and arch == "Qwen3ForCausalLM":  # Qwen3Config defaults it to 128
        return None, "config.json does not give head_dim"
    rope, theta, why_not = _read_rope(config)
    if why_not:
        return None, why_not
    window = None
    if arch == "MistralForCausalLM":
        window = config.get("sliding_window", 4096)  # MistralConfig's default; null: none
    elif config.get("use_sliding_window") or "sliding_attention" in (
        config.get("layer_types") or ()
    ):
        return None, "Qwen's per-layer sliding windows"
    attention_bias = bool(get("attention_bias")) and arch in (
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
    )
    dtype = config.get("dtype") or config.get("torch_dtype")
    shape = DecoderShape(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        head_dim=head_dim or config["hidden_size"] // heads,
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=rope,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
        o_bias=attention_bias,
        mlp_bias=bool(get("mlp_bias")) and arch == "LlamaForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        initializer_range=float(config.get("initializer_range") or 0.02),
        dtype=dtype if isinstance(dtype, str) else None,
    )
    if heads % shape.num_key_value_heads:
        return None, f"{heads} attention heads over {shape.num_key_value_heads} KV heads"
    return shape, ""


def _read_rope(config: dict[str, Any]) -> tuple[dict[str, Any] | None, float, str]:
    """(the scaling's parameters, None for the default RoPE; theta; why not, or "")."""
    # transformers 5 writes rope_parameters; 4.x rope_theta and rope_scaling (which 5 reads
    # first, where a config has both).
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    if (
        scaling
        and parameters
        and any(parameters.get(k, v) != v for k, v in scaling.items() if k != "type")
    ):
        return None, 0.0, "rope_scaling and rope_parameters that differ"
    rope = dict(scaling or parameters or {})
    if any(isinstance(value, dict) for value in rope.values()):
        return None, 0.0, "RoPE parameters per layer type"
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        return None, 0.0, f"RoPE type {rope_type!r} (runs: {', '.join(sorted(ROPE_TYPES))})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None, 0.0, "a partial rotary embedding"
    theta = float(
        rope.get("rope_theta")
        or (parameters or {}).get("rope_theta")
        or config.get("rope_theta")
        or COMMON_DEFAULTS["rope_theta"]
    )
    if rope_type == "default":
        return None, theta, ""
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor"]
        # As transformers 5: the top-level value wins, else the context length.
        original = config.get("original_max_position_embeddings")
        if (
            original is not None
            and rope.get("original_max_position_embeddings", original) != original
        ):
            return None, 0.0, "two original_max_position_embeddings that differ"
        rope.setdefault(
            "original_max_position_embeddings", original or config["max_position_embeddings"]
        )
    missing = [key for key in needed if rope.get(key) is None]
    if missing:
        return None, 0.0, f"{rope_type} RoPE without {', '.join(missing)}"
    return {**rope, "rope_type": rope_type}, theta, ""


def inverse_frequencies(shape: DecoderShape) -> torch.Tensor:
    """RoPE's inverse frequencies in float32, computed as transformers computes them."""
    dim = shape.head_dim
    inv_freq = 1.0 / (
        shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = shape.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, those between blended.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
