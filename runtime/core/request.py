"""Request: one sequence's scheduling state (tokens, computed tokens, status).

The engine builds it from a tokenized prompt; the scheduler queues it and appends sampled tokens.
"""

from __future__ import annotations

import enum

from loomllm.core.ngram_proposer import NgramIndex
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, KV blocks freed, to be recomputed
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt plus what has been generated for it, and how much of it the KV cache holds.

    `num_computed_tokens` counts the tokens whose KV is in the cache *after the step
    that was last scheduled* (the scheduler advances it in `schedule()`); the tokens
    from there to `num_tokens` are what the next step has to compute.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "status",
        "stop_reason",
        "max_tokens",
        "num_output_placeholders",
        "_all_token_ids",
        "priority",
        "queue_order",
        "token_type_ids",
        "draft_token_ids",
        "ngram_index",
        "proposed_drafts",
        "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        arrival_time: float,
        priority: int = 0,
        token_type_ids: list[int] | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_type_ids = token_type_ids  # an encoder's segments (NewRequestData's)
        # Speculative decoding: the drafts the step in flight verifies after its last token.
        self.draft_token_ids: list[int] = []
        self.ngram_index: NgramIndex | None = None  # its n-grams, for the drafts
        self.proposed_drafts: list[int] = []  # a draft model's, for the next step
        self.lora = lora  # its LoRA adapter; None: the base model
        self.priority = priority  # lower first, under the "priority" scheduling policy
        self.queue_order: int | None = None  # its first place in a priority queue (ties)
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Tokens scheduled to be sampled whose ids have not come back yet: one while a
        # step is in flight, two with async scheduling (the next step went out already).
        self.num_output_placeholders = 0
        room = max_model_len - len(prompt_token_ids)
        requested = sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        # Prompt and output tokens are also kept in one list, so reading all of them never copies.
        self._all_token_ids: list[int] = list(prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_wire_ids(self) -> int:
        """About how many ids its NewRequestData carries: its tokens, its allowed ids, its
        logit bias (an id and a float, as much as three ids) and its bad words' ids."""
        params = self.sampling_params
        return (
            len(self._all_token_ids)
            + len(params.allowed_token_ids or ())
            + 3 * len(params.logit_bias or ())
            + sum(len(seq) + 1 for seq in params.bad_words_token_ids)
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens; a live view: read it, never mutate it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's word once finished: "stop", "length" or "abort"; else None."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
