"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa), which embed but do not generate: loaded
with transformers' base model, their attention bidirectional (attention/bidirectional.py)."""

from __future__ import annotations

from typing import Any

import torch

# Architecture -> its model_type.
ENCODERS = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "RobertaModel": "roberta",
    "RobertaForMaskedLM": "roberta",
    "XLMRobertaModel": "xlm-roberta",
    "XLMRobertaForMaskedLM": "xlm-roberta",
}
# Their positions count from padding_idx + 1 (RoBERTa's embeddings skip the padding id).
_OFFSET_TYPES = ("roberta", "xlm-roberta")


def position_offset(config: Any) -> int:
    """What the model adds to a token's position to index its position embeddings."""
    if config.model_type in _OFFSET_TYPES:
        return int(config.pad_token_id) + 1
    return 0


def max_tokens(config: Any) -> int:
    """The longest prompt its position embeddings cover."""
    return int(config.max_position_embeddings) - position_offset(config)


def load_encoder(
    model_dir: Any, torch_dtype: torch.dtype, device: torch.device, dummy: bool
) -> Encoder:
    """The encoder's base model (AutoModel: a masked-LM checkpoint's head is left out)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_dir)
    if dummy:
        with device:
            base = AutoModel.from_config(config, dtype=torch_dtype, add_pooling_layer=False)
    else:
        base = AutoModel.from_pretrained(
            model_dir,
            config=config,
            dtype=torch_dtype,
            device_map={"": device},
            add_pooling_layer=False,
        )
    return Encoder(base)


class Encoder(torch.nn.Module):
    """A transformers encoder as the model runner calls a model: its last hidden states over
    a packed step, each request's positions counted as the model counts them."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base
        self.config = base.config
        self.offset = position_offset(base.config)

    def set_attn_implementation(self, name: str) -> None:
        self.base.set_attn_implementation(name)  # type: ignore[operator]

    def last_hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """[1, T, H] for input_ids and positions [1, T]."""
        out = self.base(
            input_ids=input_ids, position_ids=positions + self.offset, attn_metadata=meta
        )
        return out.last_hidden_state
