"""loomllm's own Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), read from config.json and
safetensors without transformers' modeling code.

Why: importing transformers' modeling code (torch._dynamo, torch.distributed.tensor and sympy
come with it) was most of a cold start's imports: 2.6 of 4.2 s here, 8-10 of 14.5-18 s on
the H100 host. The model also packs q|k|v and gate|up into one matmul each from the start,
and on the CUDA path runs the fused kernels of workers.fused_ops, the residual add of each
layer inside the next layer's norm.

The arithmetic is transformers' eager one, rounding for rounding, so greedy tokens match
HF `generate` (tests/test_llama_family.py, and the parity tests through the engine). A
config this module does not fully understand (a RoPE type other than default, linear and
llama3, Qwen's sliding windows, quantization, a missing field whose default differs between
the architectures) is left to transformers: `read_shape` says why.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from workers import attention

logger = logging.getLogger(__name__)

ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM"})  # fmt: skip
# A config.json with no `architectures` (a config saved alone) names its model_type only.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# Fields every one of the four config classes defaults alike (transformers 4.56 to 5.x), so
# a config.json written without them (save_pretrained drops defaults) means these values.
COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
}  # fmt: skip
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "max_position_embeddings")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What the model is made of, from config.json; field names as in transformers' configs
    (workers.model_runner.kv_geometry reads them)."""

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
    """The model's shape if this module runs it, else None and why not."""
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
    elif config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types")
                                                                     or ()):  # fmt: skip
        return None, "Qwen's per-layer sliding windows"
    attention_bias = bool(get("attention_bias")) and arch in ("LlamaForCausalLM",
                                                              "Qwen3ForCausalLM")  # fmt: skip
    dtype = config.get("dtype") or config.get("torch_dtype")
    shape = DecoderShape(
        architecture=arch, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads, head_dim=head_dim or config["hidden_size"] // heads,
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=float(get("rms_norm_eps")), rope_theta=theta, rope_scaling=rope,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM", o_bias=attention_bias,
        mlp_bias=bool(get("mlp_bias")) and arch == "LlamaForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window,
        initializer_range=float(config.get("initializer_range") or 0.02),
        dtype=dtype if isinstance(dtype, str) else None,
    )  # fmt: skip
    if heads % shape.num_key_value_heads:
        return None, f"{heads} attention heads over {shape.num_key_value_heads} KV heads"
    return shape, ""


def _read_rope(config: dict[str, Any]) -> tuple[dict[str, Any] | None, float, str]:
    """(the scaling's parameters, None for the default RoPE; theta; why not, or "")."""
    # transformers 5 writes rope_parameters; 4.x rope_theta and rope_scaling (which 5 reads
    # first, where a config has both).
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    if scaling and parameters and any(parameters.get(k, v) != v for k, v in scaling.items()
                                      if k != "type"):  # fmt: skip
        return None, 0.0, "rope_scaling and rope_parameters that differ"
    rope = dict(scaling or parameters or {})
    if any(isinstance(value, dict) for value in rope.values()):
        return None, 0.0, "RoPE parameters per layer type"
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        return None, 0.0, f"RoPE type {rope_type!r} (runs: {', '.join(sorted(ROPE_TYPES))})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None, 0.0, "a partial rotary embedding"
    theta = float(rope.get("rope_theta") or (parameters or {}).get("rope_theta")
                  or config.get("rope_theta") or COMMON_DEFAULTS["rope_theta"])  # fmt: skip
    if rope_type == "default":
        return None, theta, ""
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor"]
        # As transformers 5: the top-level value wins, else the context length.
        original = config.get("original_max_position_embeddings")
        if original is not None and rope.get("original_max_position_embeddings",
                                             original) != original:  # fmt: skip
            return None, 0.0, "two original_max_position_embeddings that differ"
        rope.setdefault("original_max_position_embeddings",
                        original or config["max_position_embeddings"])  # fmt: skip
    missing = [key for key in needed if rope.get(key) is None]
    if missing:
        return None, 0.0, f"{rope_type} RoPE without {', '.join(missing)}"
    return {**rope, "rope_type": rope_type}, theta, ""


def inverse_frequencies(shape: DecoderShape) -> torch.Tensor:
    """RoPE's inverse frequencies in float32, computed as transformers computes them."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float()
                                           / dim))  # fmt: skip
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


class Linear(torch.nn.Linear):
    """nn.Linear with no initialization: `build` fills the weights (no time spent drawing
    random values that the checkpoint's replace)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(torch.nn.Embedding):
    """nn.Embedding with no initialization, as `Linear`."""

    def reset_parameters(self) -> None:
        pass


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor  # [1, kept tokens, vocab]


class RMSNorm(torch.nn.Module):
    """transformers' Llama RMSNorm: weight * (x / rms(x)) in float32, rounded to x's dtype
    before the weight; the fused kernel computes the same on the CUDA path."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from workers.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(norm(residual + x), residual + x): a residual add and the norm after it."""
        if self.fused:
            from workers.fused_ops import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return self.forward(total), total


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' eager rotary embedding of x [1, heads, T, D] by cos, sin [1, 1, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None) -> torch.Tensor:  # fmt: skip
    """Each row of q [B, H, T, D] over its own k, v [B, KVH, T, D], causal: [B, T, H, D]. A
    forward with no KV cache (checks and tests), which the worker never runs."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


class Attention(torch.nn.Module):
    def __init__(self, shape: DecoderShape, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # workers.attention finds the layer's KV cache by it
        self.shape = shape
        size = shape.q_size + 2 * shape.kv_size
        self.qkv_proj = Linear(shape.hidden_size, size, bias=shape.qkv_bias)
        self.o_proj = Linear(shape.q_size, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.scaling = shape.head_dim**-0.5
        self.fused_rotary = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: attention.AttentionMetadata | None) -> torch.Tensor:  # fmt: skip
        shape = self.shape
        tokens = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split([shape.q_size, shape.kv_size, shape.kv_size], -1)
        q, k, v = (t.view(*tokens, -1, shape.head_dim) for t in (q, k, v))
        if shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, D]
        if self.fused_rotary:
            from workers.fused_ops import rotary

            q, k = rotary(q, k, cos, sin)
        else:
            cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = _rotate(q, cos4, sin4), _rotate(k, cos4, sin4)
        if meta is None:
            out = _causal_attention(q, k, v, self.scaling, shape.sliding_window)
        else:
            out, _ = attention.paged_attention(self, q, k, v, None, scaling=self.scaling,
                                               sliding_window=shape.sliding_window,
                                               attn_metadata=meta)  # fmt: skip
        return self.o_proj(out.reshape(*tokens, -1))


class MLP(torch.nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = Linear(shape.hidden_size, 2 * shape.intermediate_size,
                                            bias=shape.mlp_bias)  # fmt: skip
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size,
                                         bias=shape.mlp_bias)  # fmt: skip
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from workers.fused_ops import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, shape: DecoderShape, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, layer_idx)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: attention.AttentionMetadata | None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this layer's MLP output, the residual stream before it): the add of the two is
        left to the next norm, which computes it with its own (one kernel when fused)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(torch.nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(shape, i)
                                          for i in range(shape.num_hidden_layers))  # fmt: skip
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaFamilyForCausalLM(torch.nn.Module):
    """Called as the worker calls a transformers model: `model(input_ids=[1, T],
    position_ids=[1, T], attn_metadata=..., logits_to_keep=indices).logits`; or with no
    attn_metadata, `model(input_ids [B, T]).logits`: each row one causal sequence, no KV
    cache (checks and tests). Parameter names are the checkpoint's, with q|k|v packed as
    `qkv_proj` and gate|up as `gate_up_proj` (`copy_weights` maps them)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderModel(shape)
        if shape.tie_word_embeddings:  # the embedding's weight (tie_weights): none of its own
            with torch.device("meta"):
                self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        else:
            self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # Filled by `build`, in float32 whatever the model's dtype.
        self.register_buffer("inv_freq", torch.empty(shape.head_dim // 2), persistent=False)

    def tie_weights(self) -> None:
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attn_metadata: attention.AttentionMetadata | None = None,
                logits_to_keep: torch.Tensor | None = None, use_cache: bool = False,
                ) -> CausalLMOutput:  # fmt: skip
        hidden = self.model.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        # As transformers' LlamaRotaryEmbedding: float32 angles, cos and sin in the model's
        # dtype (every supported RoPE type scales them by 1).
        freqs = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        if logits_to_keep is not None:  # the norm and lm_head only where a logit is used
            hidden, residual = hidden[:, logits_to_keep], residual[:, logits_to_keep]
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return CausalLMOutput(self.lm_head(hidden))

    def use_fused_kernels(self) -> tuple[int, int]:
        """Run workers.fused_ops' kernels from now on: (RMSNorm modules, decoder layers)."""
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        for norm in norms:
            norm.fused = True
        for layer in self.model.layers:
            layer.mlp.fused = True
            head_dim = self.shape.head_dim
            layer.self_attn.fused_rotary = head_dim >= 2 and head_dim & (head_dim - 1) == 0
        return len(norms), len(self.model.layers)


# Checkpoint tensors that are packed here: (our parameter, which part of it).
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def build(shape: DecoderShape, dtype: torch.dtype, device: torch.device, model_dir: Path,
          load_format: str) -> LlamaFamilyForCausalLM:  # fmt: skip
    """The model on `device` in `dtype`: its weights read from model_dir's safetensors, or
    random ("dummy", drawn as transformers initializes them, on the device)."""
    # Uninitialized tensors, made where they run in the dtype they run in: every one is
    # filled below. (Not on the meta device: moving from it imports sympy, 0.3 s.)
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


def copy_weights(model: LlamaFamilyForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                 where: str = "the weights") -> None:  # fmt: skip
    """Copy (name, tensor) pairs named as in a transformers checkpoint (or state dict) into
    `model`, packing q|k|v and gate|up. ValueError naming the tensor on a name this model
    lacks, a shape that differs, or one missing from `tensors`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shape = model.shape
    part_sizes = {"qkv_proj": (shape.q_size, shape.kv_size, shape.kv_size),
                  "gate_up_proj": (shape.intermediate_size,) * 2}  # fmt: skip
    unfilled = {name: set(range(len(part_sizes.get(name.split(".")[-2], (0,)))))
                for name in params}  # fmt: skip
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
        target = params.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {key!r} has no place in this "
                             f"{shape.architecture}")  # fmt: skip
        if part is not None:
            sizes = part_sizes[name.split(".")[-2]]
            start = sum(sizes[:part])
            target = target[start : start + sizes[part]]
        if tensor.shape != target.shape:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)}")  # fmt: skip
        target.copy_(tensor)
        unfilled[name].discard(part or 0)
    missing = [name for name, parts in unfilled.items() if parts]
    if missing:
        raise ValueError(f"{where} lack {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _packed_name(key: str) -> tuple[str, int | None]:
    """Our parameter for a checkpoint tensor, and its part where packed."""
    *path, module, leaf = key.split(".")
    packed = _PACKED.get(module)
    if packed is None:
        return key, None
    return ".".join([*path, packed[0], leaf]), packed[1]
