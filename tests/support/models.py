"""Tiny random-weight models built on the fly: word-level, chat and character vocabularies,
and SmolLM2 under a KV cache small enough to preempt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from support.managers import ManagerHandle

TINY_VOCAB = 256
# Every tiny decoder's shape; each architecture adds its own fields.
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **shape: Any) -> str:
    """Save a tiny random-weight decoder of architecture `arch`, with a tokenizer, to `path`;
    `shape` overrides entries of TINY_SHAPE."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    model_cls(config_cls(**{**TINY_SHAPE, **extra, **shape})).save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)


# Gemma 3's text model: windows of 8 tokens on every other layer.
GEMMA3_TEXT: dict[str, Any] = dict(
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention"],
    initializer_range=0.2,
)
# Llama 4's text model: a NoPE layer of full attention whose query temperature binds from
# position 3 on, with a dense MLP; then a rotary layer with chunked attention (chunks of
# 64, so the context stops there) and experts with a shared one.
LLAMA4_TEXT: dict[str, Any] = dict(
    head_dim=16,
    intermediate_size_mlp=96,
    no_rope_layers=[0, 1],
    interleave_moe_layer_step=2,
    num_local_experts=4,
    attention_chunk_size=64,
    floor_scale=4,
    attn_scale=0.5,
    initializer_range=0.2,
)
# DeepSeek's latent attention over a 16-dim latent, a dense first layer, then routed experts
# with a shared one.
DEEPSEEK_MLA: dict[str, Any] = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)
# A multimodal checkpoint's vision tower, which text never reaches.
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


# Each architecture's tiny config, its features set so that they change the result:
# softcaps low enough to bind, windows shorter than the prompts, multipliers far from 1.
ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            sliding_window=8,
            query_pre_attn_scalar=24,
            initializer_range=0.2,
        ),
    ),
    "gemma3_text": ("Gemma3TextConfig", GEMMA3_TEXT),
    "phi3": ("Phi3Config", dict(pad_token_id=0, sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    "olmo2": ("Olmo2Config", dict(pad_token_id=0)),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    # Gemma 3's multimodal checkpoint, given text: its vision tower is loaded and idle.
    "gemma3": (
        "Gemma3Config",
        dict(
            text_config=GEMMA3_TEXT,
            vision_config=TINY_VISION,
            mm_tokens_per_image=4,
            image_token_index=TINY_VOCAB - 1,
            boi_token_index=TINY_VOCAB - 2,
            eoi_token_index=TINY_VOCAB - 3,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # Multi-head latent attention: K of 16 + 8 dims against V of 16 (V2), or of 32 (V3, whose
    # q also goes through a low-rank projection, and whose experts are routed by group).
    "deepseek_v2": ("DeepseekV2Config", {**DEEPSEEK_MLA, "q_lora_rank": None, "v_head_dim": 16}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {**DEEPSEEK_MLA, "q_lora_rank": 24, "v_head_dim": 32, "n_group": 2, "topk_group": 1},
    ),
    "llama4_text": ("Llama4TextConfig", LLAMA4_TEXT),
    # Llama 4's multimodal checkpoint, given text: its vision tower is not loaded.
    "llama4": (
        "Llama4Config",
        dict(
            text_config=LLAMA4_TEXT,
            vision_config={
                **TINY_VISION,
                "vision_output_dim": 32,
                "projector_input_dim": 32,
                "projector_output_dim": 32,
            },
            image_token_index=TINY_VOCAB - 1,
        ),
    ),
}


def make_tiny_arch(path: Path, arch: str, seed: int = 0) -> str:
    """Save a tiny random-weight model of `arch` (a key of ARCH_CONFIGS), with a tokenizer."""
    torch.manual_seed(seed)
    name, extra = ARCH_CONFIGS[arch]
    if "text_config" in extra:  # a multimodal config: the shape is its text tower's
        extra = {**extra, "text_config": {**TINY_SHAPE, **extra["text_config"]}}
        config = getattr(transformers, name)(**extra)
    else:
        config = getattr(transformers, name)(**{**TINY_SHAPE, **extra})
    # A multimodal config's own class, which transformers' causal-LM mapping may not build.
    auto = transformers.AutoModelForImageTextToText if "text_config" in extra else None
    model = (auto or transformers.AutoModelForCausalLM).from_config(config)
    with torch.no_grad():
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):  # gpt-oss starts them at zero
                sinks.normal_(0.0, 1.0)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)


def save_tiny_tokenizer(path: Path, wrap: bool = False, segments: bool = False) -> None:
    """A word-level tokenizer over the tiny vocabulary: token i is the word "w{i}". With
    `wrap`, an encoder's: special tokens wrap a text as "w1 ... w2", and "w0" pads; with
    `segments` too, BERT's: a pair's second text is marked (token_type_ids 1)."""

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if wrap:
        tok.post_processor = processors.TemplateProcessing(
            single="w1 $A w2",
            pair="w1 $A w2 $B:1 w2:1" if segments else "w1 $A w2 $B w2",
            special_tokens=[("w1", 1), ("w2", 2)],
        )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "w1",
        "eos_token": "w2",
        "unk_token": "w0",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if wrap:
        config.update(cls_token="w1", sep_token="w2", pad_token="w0")
        # As BERT's tokenizer (RoBERTa's: none): the segments, for segment embeddings.
        names = ["input_ids", "token_type_ids", "attention_mask"] if segments else []
        config["model_input_names"] = names or ["input_ids", "attention_mask"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))


CHAT_TEMPLATE = (
    "{% for m in messages %}w{{ 10 + loop.index }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)


# SmolLM2's KV bytes a block in float32: K and V, 30 layers, 16 tokens, 3 KV heads x 64.
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def preempting_smollm2(
    manager: ManagerHandle, num_blocks: int, max_num_batched_tokens: int, async_scheduling: bool
) -> Any:
    """A blocking LLM on SmolLM2 (float32) whose KV cache holds `num_blocks` blocks of 16
    tokens: a batch of a few prompts is preempted and recomputed, its prompts chunked."""
    from loomllm import LLM

    return LLM(
        "smollm2",
        manager_socket=manager.socket,
        dtype="float32",
        quantization="none",  # the dequantized weights, which HF's reference runs
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=num_blocks * SMOLLM2_BLOCK_BYTES,
        max_model_len=160,
        async_scheduling=async_scheduling,
    )


def make_char_model(path: Path) -> str:
    """A tiny random llama whose tokens are single characters (ids 3 to 127: ASCII), with a
    chat template: a vocabulary that can spell JSON, for structured outputs and tool calls."""

    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_SHAPE, "vocab_size": 128})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{chr(i): i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return str(path)


COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


# A small theta and original length, so that the prompt's positions turn every one of its
# three bands of wavelengths (kept, blended, slowed) by a visible angle.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


VARIANTS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-llama3-rope": (transformers.LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "llama-biases-tied": (
        transformers.LlamaConfig,
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 8}),
}


PROMPT = [5, 9, 2, 40, 7, 7, 13, 3, 61, 30, 11, 4, 50, 22, 8, 1, 33, 4, 90, 12]


def save_variant(path: Path, variant: str, seed: int = 3) -> Path:
    config_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, **extra))
    if extra.get("attention_bias") or extra.get("mlp_bias"):  # HF initializes biases to 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


# Tiny encoders: BERT's, RoBERTa's (positions from pad_token_id + 1) and XLM-RoBERTa's.
ENCODER_CONFIGS: dict[str, tuple[str, str]] = {
    "bert": ("BertConfig", "BertModel"),
    "roberta": ("RobertaConfig", "RobertaModel"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel"),
}


def make_tiny_encoder(path: Path, arch: str, seed: int = 0, num_labels: int | None = None) -> str:
    """Save a tiny random-weight encoder of `arch` (a key of ENCODER_CONFIGS) with the tiny
    word-level tokenizer, which wraps a text as BERT's does: "w1" (CLS) ... "w2" (SEP), and
    a pair as "w1 A w2 B w2". With `num_labels`, a classifier (`*ForSequenceClassification`)
    with that many labels, named "label-i"."""
    torch.manual_seed(seed)
    config_name, model_name = ENCODER_CONFIGS[arch]
    labels = (
        {}
        if num_labels is None
        else {
            "num_labels": num_labels,
            "id2label": {i: f"label-{i}" for i in range(num_labels)},
            "label2id": {f"label-{i}": i for i in range(num_labels)},
        }
    )
    if num_labels is not None:
        model_name = model_name.removesuffix("Model") + "ForSequenceClassification"
    config = getattr(transformers, config_name)(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=130,
        type_vocab_size=2 if arch == "bert" else 1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,  # scores spread out, so that a wrong one shows
        **labels,
    )
    getattr(transformers, model_name)(config).save_pretrained(path)
    save_tiny_tokenizer(path, wrap=True, segments=arch == "bert")
    return str(path)


def make_pooling_model(
    path: Path, arch: str, pooling: str | None, normalize: bool = True, **config: Any
) -> str:
    """A tiny model (make_tiny_model's decoder, or make_tiny_encoder's for an encoder `arch`)
    laid out as a sentence-transformers model pooling by `pooling` ("lasttoken",
    "mean_tokens", "cls_token"; None: no sentence-transformers files), with a Normalize
    module if `normalize`; `config` goes into its config.json."""
    if arch in ENCODER_CONFIGS:
        make_tiny_encoder(path, arch)
    else:
        make_tiny_model(path, arch)
    if config:
        config_file = path / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    if pooling is None:
        return str(path)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    modules += [("2_Normalize", "Normalize")] if normalize else []
    (path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": i,
                    "name": str(i),
                    "path": folder,
                    "type": f"sentence_transformers.models.{t}",
                }
                for i, (folder, t) in enumerate(modules)
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    pooling_config = {"word_embedding_dimension": TINY_SHAPE["hidden_size"]}
    pooling_config[f"pooling_mode_{pooling}"] = True
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return str(path)


def make_lora_adapter(
    base: str, path: Path, seed: int, targets: list[str], rank: int = 4, **config: Any
) -> str:
    """A PEFT LoRA adapter of `base` with random (non-zero) weights on `targets`, saved to
    `path`; `config`: more LoraConfig fields (lora_alpha, use_rslora, ...)."""
    import warnings

    import peft

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    lora = peft.LoraConfig(r=rank, target_modules=targets, init_lora_weights=False, **config)
    with warnings.catch_warnings():  # peft's calls of transformers' deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        peft.get_peft_model(model, lora).save_pretrained(path)
    return str(path)


def lora_reference(base: str, adapter: str | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for `prompt` with `adapter` merged into `base` (None: the
    base model alone)."""
    import warnings

    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        with warnings.catch_warnings():  # peft's calls of transformers' deprecated names
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
