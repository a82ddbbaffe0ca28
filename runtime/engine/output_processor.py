"""Turns the scheduler's per-step token lists into RequestOutputs: text, logprobs, stop strings.

Stop strings are found here and reported back, so that the scheduler finishes those requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loomllm.core.scheduler import EngineCoreOutput
from loomllm.metrics.counters import EngineMetrics
from loomllm.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputCollector,
)
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.messages import PooledOutput, PromptLogprobs, TopLogprobs
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams
from loomllm.text.detokenizer import IncrementalDetokenizer
from loomllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass(eq=False)
class ParentRequest:
    """The user's request: prompt, params, the consumer's collector, and its n children.

    With n > 1 the scheduler runs n child requests; the parent gathers their outputs, and the
    prompt logprobs, which arrive per prefill chunk until the whole prompt is scored.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    collector: RequestOutputCollector
    metrics: RequestMetrics
    children: dict[int, CompletionOutput] = field(default_factory=dict)
    priority: int = 0  # lower first, under the "priority" scheduling policy
    num_cached_tokens: int = 0
    # One entry per prompt token while being filled (params.prompt_logprobs set): child 0
    # alone asks the workers, n > 1 children share the prompt.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs_missing: int = 0
    prompt_logprobs_sent: bool = False  # DELTA sends them once
    pooled: np.ndarray | None = None  # runner="pooling": the prompt's embedding
    token_type_ids: list[int] | None = None  # a cross-encoder's pair: each token's segment
    lora: LoRARequest | None = None  # its LoRA adapter; None: the base model

    def _prompt_logprobs_to_send(self) -> list[dict[int, Logprob] | None] | None:
        if self.prompt_logprobs is None or self.num_prompt_logprobs_missing:
            return None
        if self.params.output_kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def child_ids(self) -> list[str]:
        if self.params.n == 1:
            return [self.request_id]
        return [f"{i}_{self.request_id}" for i in range(self.params.n)]

    @property
    def finished(self) -> bool:
        if self.params.n == 1:  # one sequence (most requests): no scan
            child = self.children.get(0)
            return child is not None and child.finish_reason is not None
        return len(self.children) == self.params.n and all(
            c.finished() for c in self.children.values()
        )

    def emit(self, latest: CompletionOutput) -> None:
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        if kind == RequestOutputKind.DELTA or len(self.children) == 1:
            outputs = [latest]  # with a single child, the latest is the only one
        else:
            outputs = [self.children[i] for i in sorted(self.children)]
        self.collector.put(
            RequestOutput(
                self.request_id,
                self.prompt,
                self.prompt_token_ids,
                outputs,
                finished,
                self.metrics,
                self.num_cached_tokens,
                self._prompt_logprobs_to_send(),
                self.pooled,
            )
        )


@dataclass(eq=False)
class RequestState:
    """One child sequence (one scheduler request): its tokens, text and logprobs so far."""

    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    # As vLLM's: summed where the request asked for logprobs (the sampler computes them for
    # its rows only), else None.
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None  # this sequence's, for the inter-token latency


class OutputProcessor:
    """Owns the RequestStates of the engine's live requests."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.states: dict[str, RequestState] = {}
        self.metrics = EngineMetrics()

    def add(self, parent: ParentRequest) -> list[str]:
        """Register a request; returns its child request ids for the scheduler."""
        self.parents[parent.request_id] = parent
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
            parent.num_prompt_logprobs_missing = len(parent.prompt_token_ids) - 1
        child_ids = parent.child_ids()
        for index, child_id in enumerate(child_ids):
            params = parent.params
            self.states[child_id] = RequestState(
                parent,
                index,
                IncrementalDetokenizer(
                    self.tokenizer,
                    parent.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        return child_ids

    def remove(self, request_id: str, finish_reason: str = "abort") -> list[str]:
        """Forget a request (aborted, or failed); returns the child ids to abort.

        Its unfinished sequences count as finished with `finish_reason` in the metrics, and
        its stream gets their last output with that reason (a consumer still reading, of a
        request aborted by id, sees it end; one that left, or got an error, never reads it).
        """
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        now = time.time()
        child_ids = parent.child_ids()
        for child_id in child_ids:
            state = self.states.pop(child_id, None)
            if state is not None:
                self.metrics.record_finished(finish_reason, parent.metrics.arrival_time, now)
                state.finish_reason = finish_reason
                parent.emit(self._completion(state))
        return child_ids

    def add_prompt_logprobs(self, chunks: list[PromptLogprobs]) -> None:
        """Fill in one step's prompt logprobs; call before `process` of the same step."""
        decoded: dict[int, str] = {}

        def decode(token_id: int) -> str:
            text = decoded.get(token_id)
            if text is None:
                text = decoded[token_id] = self.tokenizer.decode([token_id], False)
            return text

        for chunk in chunks:
            state = self.states.get(chunk.req_id)
            if state is None or state.parent.prompt_logprobs is None:
                continue  # aborted while the step ran
            parent = state.parent
            entries = parent.prompt_logprobs
            assert entries is not None and 1 <= chunk.start
            assert chunk.start + len(chunk.token_logprobs) <= len(entries)
            rows = zip(
                chunk.token_logprobs.tolist(),
                chunk.ranks.tolist(),
                chunk.top_token_ids.tolist(),
                chunk.top_logprobs.tolist(),
                strict=True,
            )
            for position, (logprob, rank, top_ids, top_lps) in enumerate(rows, chunk.start):
                token_id = parent.prompt_token_ids[position]
                entry = {token_id: Logprob(logprob, rank, decode(token_id))}
                for top_rank, (tid, lp) in enumerate(zip(top_ids, top_lps, strict=True), 1):
                    if tid not in entry:  # the prompt token keeps its own rank (ties)
                        entry[tid] = Logprob(lp, top_rank, decode(tid))
                if entries[position] is None:  # a recompute after preemption refills it
                    parent.num_prompt_logprobs_missing -= 1
                entries[position] = entry

    def add_pooled(self, pooled: list[PooledOutput]) -> None:
        """Keep one step's embeddings for their requests; call before `process`, which ends
        those requests (their placeholder token) and sends them."""
        for out in pooled:
            state = self.states.get(out.req_id)
            if state is not None:  # else aborted while the step ran
                state.parent.pooled = out.embedding

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Stream one step's results; returns child ids that a stop string finished."""
        now = time.time()
        stopped: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            if self._update(state, out, now):
                stopped.append(out.request_id)
            parent = state.parent
            # FINAL_ONLY sends nothing before the end: a sequence's output is built once, as
            # it finishes, not copied from all its tokens every step.
            if state.finish_reason is not None or parent.params.output_kind != FINAL_ONLY:
                parent.emit(self._completion(state))
            if state.finish_reason is not None:
                del self.states[out.request_id]
                self.metrics.record_finished(state.finish_reason, parent.metrics.arrival_time, now)
                if parent.finished:
                    parent.metrics.finished_time = now
                    del self.parents[parent.request_id]
        return stopped

    def abort_all(self, error: BaseException | None = None) -> None:
        """Engine shutdown: every open stream ends, with `error` or finish_reason "abort"."""
        now = time.time()
        for parent in list(self.parents.values()):
            for child_id in parent.child_ids():
                if child_id in self.states:
                    reason = "abort" if error is None else "error"
                    self.metrics.record_finished(reason, parent.metrics.arrival_time, now)
            if error is not None:
                parent.collector.put(error)
                continue
            for child_id in parent.child_ids():
                state = self.states.get(child_id)
                if state is not None:
                    state.finish_reason = "abort"
                    parent.emit(self._completion(state))
        self.parents.clear()
        self.states.clear()

    def _update(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        metrics = state.parent.metrics
        if state.index == 0:  # with n > 1, later children find the prompt child 0 cached
            state.parent.num_cached_tokens = out.num_cached_tokens
        stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        tokens, logprobs, tops = out.new_token_ids, out.new_logprobs, out.new_top_logprobs
        cut = False
        if len(tokens) > 1 and state.detokenizer.stop:
            # Several tokens at once (speculative decoding): a stop string ends the output at
            # the token that completes it, as one token a step would have.
            stop_string = None
            kept = 0
            for token in tokens:
                kept += 1
                last = kept == len(tokens)
                stop_string = state.detokenizer.update([token], stop_terminated and last)
                if stop_string is not None:
                    break
            cut = kept < len(tokens)
            tokens, logprobs, tops = tokens[:kept], logprobs[:kept], tops[:kept]
        else:
            stop_string = state.detokenizer.update(tokens, stop_terminated)
        if tokens:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.metrics.num_prompt_tokens += len(state.parent.prompt_token_ids)
            last_time = state.last_token_time
            since = metrics.arrival_time if last_time is None else last_time
            if state.parent.pooled is None:  # a pool's one token is a placeholder, not output
                self.metrics.record_tokens(len(tokens), last_time is None, since, now)
            metrics.last_token_time = state.last_token_time = now
        state.token_ids.extend(tokens)
        if state.cumulative_logprob is not None or state.logprobs is not None:
            # The sampler computes a logprob for every row whose request asks for them.
            values = [lp for lp in logprobs if lp is not None]
            if len(values) != len(logprobs):
                raise RuntimeError(
                    f"request {state.parent.request_id!r} asked for logprobs, and a token "
                    "came without one"
                )
            if state.cumulative_logprob is not None:
                state.cumulative_logprob += sum(values)
            if state.logprobs is not None:
                for token_id, lp, top in zip(tokens, values, tops, strict=True):
                    state.logprobs.append(self._logprob_entry(token_id, lp, top))
        if out.finish_reason is not None and not cut:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        elif stop_string is not None:
            state.finish_reason, state.stop_reason = "stop", stop_string
            return True
        return False

    def _logprob_entry(
        self, token_id: int, logprob: float, top: TopLogprobs | None
    ) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        if top is not None:
            for rank, (tid, lp) in enumerate(zip(top.token_ids, top.logprobs, strict=True), 1):
                entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid], False))
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, None, self.tokenizer.decode([token_id], False))
        return entry

    def _completion(self, state: RequestState) -> CompletionOutput:
        finished = state.finish_reason is not None
        delta = state.parent.params.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.num_sent_tokens :]
            logprobs = None if state.logprobs is None else state.logprobs[state.num_sent_tokens :]
            state.num_sent_tokens = len(state.token_ids)
        else:
            token_ids = list(state.token_ids)
            logprobs = None if state.logprobs is None else list(state.logprobs)
        completion = CompletionOutput(
            state.index,
            text,
            token_ids,
            state.cumulative_logprob,
            logprobs,
            state.finish_reason,
            state.stop_reason,
        )
        state.parent.children[state.index] = completion
        return completion
