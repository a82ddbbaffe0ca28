"""The random models gpu-check builds: two layers of each released model at full shapes, or
the same features at a CPU's (`--shape tiny`), and the lengths of the prompts they get."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from loomllm.benchmarks.gpu_bench import SHAPES


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the checks build: random models of these configs (two layers each), prompts of
    these lengths, and the LoRA kernel's [in, out] projections."""

    vocab: int
    archs: dict[str, tuple[str, dict[str, Any]]]
    llama: dict[str, Any]  # LoRA's and speculative decoding's base model
    pooling: dict[str, tuple[str, dict[str, Any], str]]  # with sentence-transformers pooling
    prompt_lengths: tuple[int, ...]
    lora_kernel: tuple[tuple[int, int], ...]

    def config(self, name: str, fields: dict[str, Any]) -> Any:
        import transformers

        common = dict(
            vocab_size=self.vocab,
            num_hidden_layers=2,  # a second layer's cache, DeepSeek's dense first layer
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        return getattr(transformers, name)(**{**common, **fields})

    def prompts(self, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, self.vocab) for _ in range(n)] for n in lengths]


# The released models' layers, with their features set so that they bind: windows shorter
# than the longest prompt, and Gemma 2's weights wide enough for its softcaps to cap.
FULL_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral (Mixtral-8x7B's layers)": (
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
    "deepseek_v2 (DeepSeek-V2-Lite's latent attention and experts)": (
        "DeepseekV2Config",
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "gpt_oss (gpt-oss-20b's sinks, window and experts)": (
        "GptOssConfig",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma2 (Gemma-2-9B's softcaps, window and head size 256)": (
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=256,
            initializer_range=0.15,
        ),
    ),
}
FULL_POOLING: dict[str, tuple[str, dict[str, Any], str]] = {
    "decoder, last token": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        "lasttoken",
    ),
    "encoder, mean": (
        "BertConfig",
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            max_position_embeddings=512,
            initializer_range=0.2,
        ),
        "mean_tokens",
    ),
}
# Llama-3-8B's layers, Qwen3-Embedding-0.6B's and BERT-base's.
FULL = Shapes(
    vocab=32000,
    archs=FULL_ARCHS,
    # `loom bench gpu`'s 8B shape, less what config() sets for every model.
    llama={
        key: value
        for key, value in SHAPES["llama-8b"].items()
        if key not in ("arch", "vocab_size", "num_hidden_layers", "max_position_embeddings")
    },
    pooling=FULL_POOLING,
    prompt_lengths=(7, 64, 300, 700, 1100),  # past every window
    lora_kernel=((4096, 6144), (4096, 28672), (14336, 4096)),  # q|k|v, gate|up, down
)
_SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
# The same features at a CPU's shapes (`--shape tiny`): the checks' own smoke test.
TINY = Shapes(
    vocab=256,
    archs={
        "mixtral": ("MixtralConfig", dict(_SMALL, num_local_experts=4, sliding_window=None)),
        "deepseek_v2": (
            "DeepseekV2Config",
            dict(
                _SMALL,
                num_key_value_heads=4,
                moe_intermediate_size=32,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
            ),
        ),
        "gpt_oss": (
            "GptOssConfig",
            dict(
                _SMALL,
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        "gemma2": (
            "Gemma2Config",
            dict(
                _SMALL,
                head_dim=16,
                query_pre_attn_scalar=16,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                sliding_window=8,
                initializer_range=0.2,
            ),
        ),
    },
    llama=_SMALL,
    pooling={
        "decoder, last token": ("Qwen3Config", dict(_SMALL, head_dim=16), "lasttoken"),
        "encoder, mean": (
            "BertConfig",
            dict(_SMALL, max_position_embeddings=130, initializer_range=0.2),
            "mean_tokens",
        ),
    },
    prompt_lengths=(7, 20, 40),
    lora_kernel=((64, 96), (100, 48)),
)
