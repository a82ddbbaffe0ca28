"""The independent reference for greedy tokens: Hugging Face `generate`, one prompt at a time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def hf_greedy(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    ignore_eos: bool = True,
    attn_implementation: str | None = None,
    **generate_kwargs: Any,
) -> list[list[int]]:
    """Each prompt's greedy continuation by transformers' model in float32. `ignore_eos`:
    generate through EOS (min_new_tokens would instead ban it); `generate_kwargs` go to
    `generate` as they are (a logits processor, a sequence bias); `attn_implementation`:
    transformers' (e.g. "eager", the one that computes softcaps and sinks)."""
    import torch

    model = (
        reference_class(model_dir)
        .from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn_implementation)
        .eval()
    )
    if ignore_eos:
        model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
                **generate_kwargs,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' own forward over `tokens`, eager attention: [T, V] float32."""
    import torch

    model = (
        reference_class(model_dir)
        .from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def reference_class(model_dir: str | Path) -> Any:
    """The class config.json names (a multimodal checkpoint's own, given text), else
    transformers' causal-LM class for its model_type."""
    import json

    import transformers

    named = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures")
    return getattr(transformers, named[0]) if named else transformers.AutoModelForCausalLM


def hf_embedding(model_dir: str, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' base model over `prompt` in float32, its last hidden states pooled as
    sentence-transformers pools them ("lasttoken", "mean_tokens" or "cls_token"): [H]."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"lasttoken": hidden[-1], "mean_tokens": hidden.mean(0), "cls_token": hidden[0]}
    vector = pooled[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
