"""loomllm's own Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): its modules and forward.

Its arithmetic is transformers' eager one, rounding for rounding, so greedy tokens match HF's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from loomllm.workers.attention import paged as attention
from loomllm.workers.attention.metadata import AttentionMetadata
from loomllm.workers.kernels.gguf_linear import GgufLayer
from loomllm.workers.models.llama.config import DecoderShape


class Linear(torch.nn.Linear):
    """nn.Linear with no initialization: `build` fills the weights (no time spent drawing
    random values that the checkpoint's replace). `skinny`: a few rows run skinny_matmul's
    kernel (set where `skinny_matmul.pick` timed it faster than cuBLAS). `gated`: a gate|up
    projection, whose kernel computes SiLU times up too (what `skinny` was timed on)."""

    skinny = False
    gated = False
    # Set by models/quantization.py: the CPU's quantized kernels, picked by batch size.
    kernels: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels(x, self.weight, self.bias)
        if self.runs_skinny(x):
            from loomllm.workers.kernels.skinny_matmul import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def runs_skinny(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the skinny kernel: few enough dense rows, and `skinny`."""
        if not self.skinny:
            return False
        from loomllm.workers.kernels.skinny_matmul import MAX_ROWS

        return x.numel() <= MAX_ROWS * x.shape[-1] and x.stride(-1) == 1


class Embedding(torch.nn.Embedding):
    """nn.Embedding with no initialization, as `Linear`."""

    def reset_parameters(self) -> None:
        pass


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor  # [1, kept tokens, vocab]


class RMSNorm(torch.nn.Module):
    """transformers' Llama RMSNorm: weight * (x / rms(x)) in float32, rounded to x's dtype
    before the weight. `kernels`, where set, computes the same in one kernel: fused_ops on
    the CUDA path, the C++ ops (kernels/cpu_native.py) on the CPU."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.kernels: Any | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a residual add and the norm after it."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return self.forward(total), total


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' eager rotary embedding of x [1, heads, T, D] by cos, sin [1, 1, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
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
    """Self-attention with q|k|v as one matmul, over the paged KV cache (or causal without)."""

    def __init__(self, shape: DecoderShape, layer_idx: int) -> None:
        super().__init__()
        # attention/paged.py finds the layer's KV cache by it.
        self.layer_idx = layer_idx
        self.shape = shape
        size = shape.q_size + 2 * shape.kv_size
        self.qkv_proj = Linear(shape.hidden_size, size, bias=shape.qkv_bias)
        self.o_proj = Linear(shape.q_size, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.scaling = shape.head_dim**-0.5
        self.fused_rotary = False
        # The C++ ops on the CPU: the rotary embedding with the cache write, in one call.
        self.cpu_kernels: Any | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        shape = self.shape
        tokens = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split([shape.q_size, shape.kv_size, shape.kv_size], -1)
        q, k, v = (t.view(*tokens, -1, shape.head_dim) for t in (q, k, v))
        if shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cpu_kernels is not None and meta is not None and meta.paged is None:
            k_cache, v_cache = meta.kv_caches[self.layer_idx]
            q = self.cpu_kernels.rotary_into_cache(
                q[0], k[0], v[0], cos[0], sin[0], k_cache, v_cache, meta.slot_mapping
            )
            out = attention.attend_cached(self, q, meta, self.scaling, shape.sliding_window)
            return self.o_proj(out.reshape(*tokens, -1))
        if self.fused_rotary and meta is not None and meta.paged is not None:
            fused = self._rotary_into_cache(q[0], k[0], v[0], cos[0], sin[0], meta)
            if fused is not None:
                return self.o_proj(fused.reshape(*tokens, -1))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, D]
        if self.fused_rotary:
            from loomllm.workers.kernels.fused_ops import rotary

            q, k = rotary(q, k, cos, sin)
        else:
            cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = _rotate(q, cos4, sin4), _rotate(k, cos4, sin4)
        if meta is None:
            out = _causal_attention(q, k, v, self.scaling, shape.sliding_window)
        else:
            out, _ = attention.paged_attention(
                self,
                q,
                k,
                v,
                None,
                scaling=self.scaling,
                sliding_window=shape.sliding_window,
                attn_metadata=meta,
            )
        return self.o_proj(out.reshape(*tokens, -1))

    def _rotary_into_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The Triton backend's attention [T, H, D] of q, k, v [T, heads, D], the rotary
        embedding and the write of K and V into the cache in one kernel (in a decode-only
        step, the attention's own); None where that kernel does not take them (the caller
        runs the two)."""
        from loomllm.workers.kernels import fused_ops

        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        if not fused_ops.rotary_into_cache_fits(q, k, v, cos, sin, k_cache, v_cache):
            return None
        window = self.shape.sliding_window
        out = attention.attend_rotating(self, q, k, v, cos, sin, meta, self.scaling, window)
        if out is not None:
            return out
        q = fused_ops.rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return attention.attend_written(self, q, meta, self.scaling, window)


class MLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) with gate|up as one matmul."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = Linear(
            shape.hidden_size, 2 * shape.intermediate_size, bias=shape.mlp_bias
        )
        self.gate_up_proj.gated = True
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.kernels: Any | None = None  # as RMSNorm's: computes silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The skinny kernel computes the activation in its epilogue.
        gate_up_proj = self.gate_up_proj
        if (
            self.kernels is not None
            and isinstance(gate_up_proj, Linear)  # not weight_dtype's HalfWeightLinear
            and gate_up_proj.runs_skinny(x)
        ):
            from loomllm.workers.kernels.skinny_matmul import skinny_silu_linear

            return self.down_proj(skinny_silu_linear(x, gate_up_proj.weight, gate_up_proj.bias))
        gate_up = gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    """Norm, attention, norm, MLP, with each residual add inside the norm after it."""

    def __init__(self, shape: DecoderShape, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, layer_idx)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
    """The embedding, the decoder layers and the final norm, named as in checkpoints."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(shape, i) for i in range(shape.num_hidden_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaFamilyForCausalLM(torch.nn.Module):
    """Called as the worker calls a transformers model: `model(input_ids=[1, T],
    position_ids=[1, T], attn_metadata=..., logits_to_keep=indices).logits`; or with no
    attn_metadata, `model(input_ids [B, T]).logits`: each row one causal sequence, no KV
    cache (checks and tests). Parameter names are the checkpoint's, with q|k|v packed as
    `qkv_proj` and gate|up as `gate_up_proj` (`copy_weights` maps them). It exists because
    importing transformers' modeling code, with torch._dynamo, torch.distributed.tensor and
    sympy, was most of a worker's cold start."""

    inv_freq: torch.Tensor  # the buffer registered in __init__

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderModel(shape)
        # A tied lm_head gets the embedding's weight from tie_weights, so its own is not allocated.
        if shape.tie_word_embeddings:
            with torch.device("meta"):
                self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        else:
            self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # Filled by `build`, in float32 whatever the model's dtype.
        self.register_buffer("inv_freq", torch.empty(shape.head_dim // 2), persistent=False)
        # On the CPU, with the C++ ops: a step's layers in one call.
        self.cpu_stack: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def float32_logits(self) -> bool:
        """Logits in float32 whatever the model's dtype, from a GGUF head: it computes from
        int8 activations either way and writes float32 as cheaply as bfloat16, so the logits
        lose no bits to a last rounding."""
        return isinstance(self.lm_head, GgufLayer)

    def tie_weights(self) -> None:
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        logits_to_keep: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> CausalLMOutput:
        hidden = self.last_hidden_states(input_ids, position_ids, attn_metadata, logits_to_keep)
        if self.float32_logits:
            hidden = hidden.float()
        return CausalLMOutput(self.lm_head(hidden))

    def last_hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's output after its final norm, [1, T, H]: what the LM head reads, and
        what a pooling model pools. `keep`: only these positions (the norm runs on those)."""
        hidden = self.model.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        # As transformers' LlamaRotaryEmbedding: float32 angles, cos and sin in the model's
        # dtype (every supported RoPE type scales them by 1).
        freqs = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        meta = attn_metadata
        if (
            self.cpu_stack is not None
            and meta is not None
            and (not meta.prefills or meta.prefill_batch is not None)
            and meta.paged is None
        ):
            hidden, residual = self.cpu_stack(hidden[0], cos[0], sin[0], meta)
            hidden, residual = hidden[None], residual[None]
        else:
            residual = None
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, cos, sin, meta)
            # The model has layers, so the loop set the residual.
            residual = cast(torch.Tensor, residual)
        if keep is not None:  # the norm and lm_head only where a logit is used
            hidden, residual = hidden[:, keep], residual[:, keep]
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def use_fused_kernels(self) -> tuple[int, int]:
        """Run fused_ops' kernels from now on (each residual add inside a norm's kernel, K/V
        written inside the rotary's or the decode attention's): (RMSNorm modules, layers)."""
        from loomllm.workers.kernels import fused_ops

        norms = self._use_kernels(fused_ops)
        # A ModuleList's items are typed as Module: these are DecoderLayers.
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            head_dim = self.shape.head_dim
            layer.self_attn.fused_rotary = head_dim >= 2 and head_dim & (head_dim - 1) == 0
        return norms, len(self.model.layers)

    def use_cpu_kernels(self, ops: Any | None) -> tuple[int, int]:
        """Run the CPU's C++ ops (kernels/cpu_native.py's torch.ops.loom_cpu) from now on:
        norms with their residual adds, SiLU times up, the rotary embedding with the K/V
        cache write, and attention over the cache in place; a step's layers in one call.
        None: torch's ops again. (RMSNorm modules, layers)."""
        from loomllm.workers.models.llama.cpu_stack import DecoderStack

        norms = self._use_kernels(ops)
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            layer.self_attn.cpu_kernels = ops
        # 16-bit weights under a float32 model (weight_dtype's HalfWeightLinear) are not in
        # the one-call stack: their layers run one by one.
        linears = [m for m in self.model.layers.modules() if hasattr(m, "in_features")]
        stacked = ops is not None and all(isinstance(m, (Linear, GgufLayer)) for m in linears)
        self.cpu_stack = DecoderStack(self, ops) if stacked else None
        return norms, len(self.model.layers)

    def _use_kernels(self, kernels: Any) -> int:
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        for norm in norms:
            norm.kernels = kernels
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            layer.mlp.kernels = kernels
        return len(norms)
