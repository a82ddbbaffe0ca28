"""PackedStep: a step's scheduled tokens packed into one [1, T] batch, and what each row does
(decode, prompt chunk, sample, score its prompt, pool); pack_step builds it from the diff."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from loomllm.protocols.messages import SchedulerOutput
from loomllm.workers.attention.metadata import PrefillRow
from loomllm.workers.runner.pooler import PoolRow
from loomllm.workers.runner.request_state import CachedRequestState


@dataclass(slots=True)
class PackedStep:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # the KV cache slot of each token
    fill_at: list[int] = field(default_factory=list)  # each input id the last step sampled
    fill_from: list[int] = field(default_factory=list)  # its row in that step's sampled ids
    sample_idx: list[int] = field(default_factory=list)  # the tokens whose logits sample
    samplers: list[CachedRequestState] = field(default_factory=list)  # one per sample_idx
    # Speculative decoding: each sampling request's first row in samplers, and its drafts.
    spec: list[tuple[int, list[int]]] = field(default_factory=list)
    prompt_idx: list[int] = field(default_factory=list)  # positions scored for prompt_logprobs
    # Each request scored: (state, its first position scored, how many).
    scored: list[tuple[CachedRequestState, int, int]] = field(default_factory=list)
    decode_idx: list[int] = field(default_factory=list)
    decode_ctx: list[array[int]] = field(default_factory=list)  # torch backend: their slots
    decode_states: list[CachedRequestState] = field(default_factory=list)
    prefills: list[PrefillRow] = field(default_factory=list)
    prefill_states: list[CachedRequestState] = field(default_factory=list)
    pool_rows: list[PoolRow] = field(default_factory=list)
    lora_tokens: dict[int, list[int]] = field(default_factory=dict)  # adapter slot -> tokens

    @property
    def rows(self) -> list[CachedRequestState]:
        """The requests in row order: decodes, then prompt chunks."""
        return self.decode_states + self.prefill_states

    @property
    def speculated(self) -> bool:
        """Whether some request samples after drafts."""
        return len(self.samplers) > len(self.spec)


def pack_step(
    so: SchedulerOutput,
    requests: dict[str, CachedRequestState],
    pending: dict[int, int],
    block_size: int,
    *,
    contexts: bool,
    lora_slots: dict[int, int] | None,
    pooling: bool,
) -> PackedStep:
    """Pack the scheduled tokens of `requests` (their states already updated by the diff).

    `pending`: rows of the previous step's sampled ids still on the device, by id(state).
    `contexts`: gather each row's context by slot (the torch backend; Triton's kernels read
    the block tables). Advances each request's num_computed_tokens past its tokens."""
    packed = PackedStep()
    fresh = {r.req_id for r in so.new_requests}  # new, or back after a preemption
    cached = so.cached
    drafts_of: dict[str, list[int]] = {}
    if cached.draft_token_ids:  # a column only where the engine speculates
        drafts_of = dict(zip(cached.req_ids, cached.draft_token_ids, strict=True))
    for req_id, num_new in so.num_scheduled_tokens.items():
        state = requests[req_id]
        token_start = len(packed.input_ids)
        if state.lora_id is not None and lora_slots is not None:
            tokens = packed.lora_tokens.setdefault(lora_slots[state.lora_id], [])
            tokens.extend(range(token_start, token_start + num_new))
        drafts = drafts_of.get(req_id) or []
        complete = _pack_tokens(packed, state, num_new, drafts, pending, so.step_id, block_size)
        # A `fresh` one-token row is a prompt chunk: attend_rotating says why.
        decode = num_new == 1 and req_id not in fresh
        _pack_roles(packed, state, token_start, num_new, drafts, decode, complete, contexts)
        if pooling:
            start = state.num_computed_tokens
            packed.pool_rows.append(PoolRow(state, token_start, start, num_new, complete))
        state.num_computed_tokens += num_new
    return packed


def _pack_tokens(
    packed: PackedStep,
    state: CachedRequestState,
    num_new: int,
    drafts: list[int],
    pending: dict[int, int],
    step_id: int,
    block_size: int,
) -> bool:
    """Add the request's input ids, positions and cache slots; whether its prompt is
    complete with them (this step samples it)."""
    start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
    known_end = end - len(drafts)  # the drafts follow the request's own tokens
    num_known = len(state.all_token_ids)
    packed.input_ids.extend(state.all_token_ids[start:known_end])
    if known_end > num_known:
        # Its last input is the token the previous step sampled: still on the device.
        if end != num_known + 1 or id(state) not in pending:
            raise RuntimeError(
                f"step {step_id}: request {state.req_id!r} computes "
                f"position {known_end - 1}, but holds {num_known} tokens"
            )
        packed.fill_at.append(len(packed.input_ids))
        packed.fill_from.append(pending[id(state)])
        packed.input_ids.append(0)
        num_known += 1
    packed.input_ids.extend(drafts)
    packed.positions.extend(range(start, end))
    blocks, bs = state.block_ids, block_size
    state.slots.extend(blocks[p // bs] * bs + p % bs for p in range(len(state.slots), end))
    packed.slots.extend(state.slots[start:end])
    return known_end == num_known


def _pack_roles(
    packed: PackedStep,
    state: CachedRequestState,
    token_start: int,
    num_new: int,
    drafts: list[int],
    decode: bool,
    complete: bool,
    contexts: bool,
) -> None:
    """Mark the request's tokens as a decode or a prompt chunk, its prompt positions to
    score, and the rows that sample."""
    start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
    if decode:
        packed.decode_idx.append(token_start)
        packed.decode_states.append(state)
        if contexts:
            packed.decode_ctx.append(state.slots[:end])
    else:
        ctx = (
            torch.frombuffer(state.slots[:end], dtype=torch.long)
            if contexts
            else torch.zeros(0, dtype=torch.long)
        )
        packed.prefills.append(PrefillRow(token_start, num_new, ctx))
        packed.prefill_states.append(state)
    if state.sampling_params.prompt_logprobs is not None and not state.output_token_ids:
        # Position p predicts prompt token p + 1: the last prompt position samples.
        num_scored = min(end, len(state.prompt_token_ids) - 1) - start
        if num_scored > 0:
            packed.prompt_idx.extend(range(token_start, token_start + num_scored))
            packed.scored.append((state, start, num_scored))
    if complete:
        # After its last token, and after each draft, to verify it.
        first = len(packed.input_ids) - len(drafts) - 1
        packed.spec.append((len(packed.samplers), drafts))
        packed.sample_idx.extend(range(first, first + len(drafts) + 1))
        packed.samplers.extend([state] * (len(drafts) + 1))
