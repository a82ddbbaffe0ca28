"""FakeWorker: the worker side of a step, in process, for scheduler and engine tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loomllm.protocols.messages import SchedulerOutput, StepResult, TopLogprobs

NextToken = Callable[[list[int], list[int]], int]  # (prompt, output) -> next token


def by_position(prompt: list[int], output: list[int]) -> int:
    """Deterministic in the tokens so far, whatever the schedule; EOS about one time in 20."""
    return (sum(prompt) * 31 + sum(output) * 7 + len(output) * 13) % 20


@dataclass
class _WorkerState:
    prompt: list[int]
    tokens: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    def __init__(self, block_size: int, num_blocks: int, next_token: NextToken = by_position):
        self.block_size = block_size
        self.next_token = next_token
        self.states: dict[str, _WorkerState] = {}
        self.kv: list[tuple[int, ...] | None] = [None] * (block_size * num_blocks)

    def slot(self, state: _WorkerState, position: int) -> int:
        block_index = position // self.block_size
        assert block_index < len(state.block_ids), "position beyond the block table"
        return state.block_ids[block_index] * self.block_size + position % self.block_size

    def execute(self, so: SchedulerOutput) -> StepResult:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.new_requests:
            assert new.req_id not in self.states
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.states[new.req_id] = _WorkerState(
                list(new.prompt_token_ids), tokens, list(new.block_ids), new.num_computed_tokens
            )
        cached = so.cached
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            state.block_ids.extend(new_block_ids)
            # The worker advanced it itself last step: both sides must agree.
            assert state.num_computed_tokens == num_computed
        batch_order = cached.req_ids + [n.req_id for n in so.new_requests]
        assert list(so.num_scheduled_tokens) == batch_order
        # Like paged attention, every layer writes all new KV before anything reads.
        spans = {}
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            assert 0 < num_new and end <= len(state.tokens)
            for pos in range(start, end):
                self.kv[self.slot(state, pos)] = tuple(state.tokens[: pos + 1])
            spans[req_id] = end
        req_ids, sampled = [], []
        for req_id, end in spans.items():
            state = self.states[req_id]
            for pos in range(end):
                assert self.kv[self.slot(state, pos)] == tuple(state.tokens[: pos + 1]), (
                    f"{req_id}: KV at position {pos} is not its own"
                )
            state.num_computed_tokens = end
            if end == len(state.tokens):
                token = self.next_token(state.prompt, state.tokens[len(state.prompt) :])
                state.tokens.append(token)
                req_ids.append(req_id)
                sampled.append(token)
        tops = [TopLogprobs([t], [-0.5]) if t % 2 else None for t in sampled]
        return StepResult(so.step_id, req_ids, sampled, [-0.5] * len(sampled), tops)
