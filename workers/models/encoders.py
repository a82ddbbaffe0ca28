"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa), which embed or classify but do not
generate: loaded with transformers' model, their attention bidirectional
(attention/bidirectional.py)."""

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
# Cross-encoders and classifiers: a head over the CLS token's hidden state (runner="pooling").
CLASSIFIERS = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
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
    """The encoder: a classifier whole (its head scores the CLS token's hidden state), any
    other as its base model (AutoModel: a masked-LM checkpoint's head is left out)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    classifier = architecture_of(config) in CLASSIFIERS
    auto: Any = AutoModelForSequenceClassification if classifier else AutoModel
    options = {} if classifier else {"add_pooling_layer": False}
    if dummy:
        with device:
            model = auto.from_config(config, dtype=torch_dtype, **options)
    else:
        model = auto.from_pretrained(
            model_dir, config=config, dtype=torch_dtype, device_map={"": device}, **options
        )
    return Encoder(model, classifier)


def architecture_of(config: Any) -> str:
    named = getattr(config, "architectures", None) or []
    return str(named[0]) if named else ""


class Encoder(torch.nn.Module):
    """A transformers encoder as the model runner calls a model: its last hidden states over
    a packed step, each request's positions counted as the model counts them; a classifier's
    logits from its CLS token's hidden state (`classify`)."""

    def __init__(self, model: torch.nn.Module, classifier: bool = False) -> None:
        super().__init__()
        self.model = model
        self.base: Any = model.base_model if classifier else model
        self.config: Any = model.config  # a transformers config
        self.offset = position_offset(model.config)
        self.is_classifier = classifier

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)  # type: ignore[operator]

    def last_hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: Any,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[1, T, H] for input_ids and positions [1, T]; token_type_ids [1, T] or None (all
        of the first segment)."""
        if getattr(self.config, "type_vocab_size", 1) < 2:
            token_type_ids = None  # RoBERTa's kin embed no segments: all are the first
        out = self.base(
            input_ids=input_ids,
            position_ids=positions + self.offset,
            token_type_ids=token_type_ids,
            attn_metadata=meta,
        )
        return out.last_hidden_state

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's logits [labels] from a request's CLS hidden state [H]. BERT's head
        reads its pooler's output, RoBERTa's the hidden state itself (both take row 0)."""
        model: Any = self.model
        rows = cls_hidden.to(next(model.classifier.parameters()).dtype)[None, None]  # [1, 1, H]
        if self.config.model_type == "bert":
            return model.classifier(model.bert.pooler(rows))[0]
        return model.classifier(rows)[0]
