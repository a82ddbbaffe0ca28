"""CachedRequestState: what the model runner keeps of one request between steps."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.sample.structured_output import RequestGrammar
from loomllm.workers.sample.token_filters import TokenFilters


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of one request between steps: a row of the persistent batch."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    banned_until_min_tokens: list[int]  # eos + stop_token_ids, masked while output < min_tokens
    block_ids: list[int]
    num_computed_tokens: int
    all_token_ids: list[int] = field(default_factory=list)
    grammar: RequestGrammar | None = None  # its structured_outputs' matcher
    filters: TokenFilters | None = None  # its allowed ids and logit bias, on the device
    # Cache slot of each position computed so far: block ids never change once given, so
    # each step extends this instead of recomputing the whole context (the hot path). An
    # array: a step copies each decode row's whole context from it, as memory.
    slots: array[int] = field(default_factory=lambda: array("q"))
    # A pooling runner's partial pool of the prompt chunks computed so far (runner/pooler.py).
    pooled: torch.Tensor | None = None
    token_type_ids: list[int] | None = None  # an encoder's segments of a pair of texts
    lora_id: int | None = None  # its LoRA adapter's lora_int_id; None: the base model

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
