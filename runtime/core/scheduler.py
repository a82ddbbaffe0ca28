"""Scheduler: continuous batching in one token budget, chunked prefill, preemption by recompute.

Between intake and the workers: `schedule()` builds a step, `update_from_output()` applies it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loomllm.config import SpeculativeConfig
from loomllm.core.kv_blocks import KVCacheManager
from loomllm.core.ngram_proposer import NgramIndex
from loomllm.core.request import Request, RequestStatus
from loomllm.core.waiting_queue import waiting_queue
from loomllm.protocols.choices import SCHEDULING_POLICIES, SchedulingPolicy
from loomllm.protocols.messages import (
    CachedRequests,
    NewRequestData,
    SchedulerOutput,
    StepResult,
    TopLogprobs,
)

# Most token ids (Request.num_wire_ids) that one step's newly admitted requests send to the
# workers. Each sends its whole prompt, prefix hits included, so many requests sharing a long
# cached prefix could otherwise outgrow the 64 MiB frame and end the engine; 4 Mi ids stay
# under 20 MiB of msgpack. One request is always admitted.
MAX_NEW_REQUEST_TOKENS = 4 * 2**20


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # requests running at once
    max_num_batched_tokens: int  # tokens computed per step, all requests together
    max_model_len: int  # prompt + output tokens of one request
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks the workers allocated
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    speculative: SpeculativeConfig | None = None  # drafts for decoding requests
    max_loras: int | None = None  # LoRA adapters running at once (None: LoRA is off)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}"
            )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_blocks",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len > capacity:
            # One request alone must always fit, or preemption could never make room.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be <= the KV cache's "
                f"{capacity} tokens (num_blocks * block_size)"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is off"
            )


class SpecDecodeCounts:
    """Speculative decoding so far: draft tokens proposed and accepted, and how often the
    draft at each position was accepted (vLLM's spec_decode metrics)."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")

    def __init__(self, k: int) -> None:
        self.num_drafts = 0  # steps of a request that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request: its new tokens and, at the end, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]  # logprob of each new token (None: not computed)
    new_top_logprobs: list[TopLogprobs | None]
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None  # the stop token id (or string) that ended it
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache


class Scheduler:
    """Continuous batching: running requests first, then waiting ones (in the policy's
    order: arrival, or priority), in one budget."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting = waiting_queue(config.scheduling_policy)  # new and preempted
        self.running: list[Request] = []  # hold KV blocks; in order of admission
        # Finished, aborted or preempted since the last schedule(): the workers forget them.
        self.finished_req_ids: dict[str, None] = {}
        self.step_id = 0  # schedule() calls so far
        self.num_preemptions = 0
        self.spec = SpecDecodeCounts(
            config.speculative.num_speculative_tokens if config.speculative else 0
        )
        # Per step in flight, the requests it samples: a result is credited to that very
        # Request, never to a new one that took its id meanwhile (an abort frees the id
        # while two steps may still be running for the old request).
        self._samplers: dict[int, dict[str, Request]] = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it could never run or its id is taken."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt < 1:
            raise ValueError("prompt_token_ids must not be empty")
        # SchedulerConfig holds max_model_len <= num_blocks * block_size, so a prompt within
        # max_model_len also fits the whole cache: alone, it can always run.
        if num_prompt > self.config.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): blocks are free on return.

        Unknown or already finished ids are ignored. The ids reach the workers in the next
        SchedulerOutput; a result for them from a step already in flight is ignored.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        removed_waiting = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                removed_waiting = True
            request.status = status
            self._free_request(request)
        if removed_waiting:
            self.waiting.drop_finished()

    def schedule(self) -> SchedulerOutput:
        """Pick the work of one step and advance `num_computed_tokens` of what it picked."""
        config = self.config
        spec = config.speculative  # None: no drafts, and no call per decode to find none
        kv = self.kv_cache_manager
        token_budget = config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequests([], [], [])
        new_requests: list[NewRequestData] = []
        new_request_tokens = 0  # the ids new_requests carry
        preempted = False

        # Running requests, in order of admission: decodes and the rest of chunked prefills.
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            placeholders = request.num_output_placeholders
            if placeholders and config.speculative is not None:
                # Async scheduling: its token is in flight. Its drafts follow that token, and
                # where its next one goes depends on how many drafts are taken: it waits.
                index += 1
                continue
            if placeholders and (
                request.num_output_tokens + placeholders >= request.max_tokens
                or request.num_tokens + placeholders >= config.max_model_len
            ):
                index += 1  # its tokens in flight reach the length limit: nothing left to compute
                continue
            num_new = min(
                request.num_tokens + placeholders - request.num_computed_tokens,
                token_budget,
                config.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                index += 1
                continue
            drafts = self._drafts(request, token_budget) if num_new == 1 and spec else []
            num_new += len(drafts)
            new_block_ids = kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                # Out of blocks: the policy's victim (FCFS: the newest running request)
                # gives its blocks back.
                victim = self.waiting.victim(self.running)
                at = self.running.index(victim)
                del self.running[at]
                if at < index:  # the loop passed the victim already (priority policy)
                    index -= 1
                if victim.request_id in num_scheduled_tokens:  # it was in this step: undo
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    k = cached.req_ids.index(victim.request_id)
                    del cached.req_ids[k], cached.new_block_ids[k], cached.num_computed_tokens[k]
                    if cached.draft_token_ids:
                        del cached.draft_token_ids[k]
                    kv.forget_unwritten(victim)  # no step will write the KV it cached
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                # The request preempted itself. Under priority the requests after it rank
                # higher and still run; under FCFS it was the last one.
                continue
            num_scheduled_tokens[request.request_id] = num_new
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if config.speculative is not None:
                cached.draft_token_ids.append(drafts)
                request.draft_token_ids = drafts
            token_budget -= num_new
            index += 1

        # Waiting requests, in the policy's order; none once this step has preempted, because
        # memory is short.
        while (
            not preempted
            and self.waiting
            and token_budget > 0
            and len(self.running) < config.max_num_seqs
        ):
            request = self.waiting.peek()
            if not self._lora_fits(request):
                break  # its adapter waits until one of those running is done with theirs
            new_request_tokens += request.num_wire_ids
            if new_requests and new_request_tokens > MAX_NEW_REQUEST_TOKENS:
                break  # this step's frame is full enough; a later step admits the request
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not config.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            if kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            self.running.append(request)
            num_scheduled_tokens[request.request_id] = num_new
            new_requests.append(self._new_request_data(request))
            token_budget -= num_new

        # As in vLLM v1, num_computed_tokens now counts the KV this step will write, while the
        # messages above carry the value from before it: where the worker starts computing.
        # update_from_output() never touches it. A step that reaches a request's end samples its
        # next token, counted as a placeholder until the id comes back; with async scheduling
        # the next step may compute that token's KV first, and the worker supplies the id.
        samplers: dict[str, Request] = {}
        for request_id, num_new in num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_new
            computed = request.num_computed_tokens - len(request.draft_token_ids)
            if computed == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # the step samples its next token
                samplers[request_id] = request
        if samplers:  # an empty step is never sent, so nothing would ever pop its entry
            self._samplers[self.step_id] = samplers
        output = SchedulerOutput(
            step_id=self.step_id,
            new_requests=new_requests,
            cached=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            finished_req_ids=list(self.finished_req_ids),
        )
        self.finished_req_ids = {}
        self.step_id += 1
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, result: StepResult
    ) -> list[EngineCoreOutput]:
        """Append each sampled token, apply the stop rules, free what finished."""
        samplers = self._samplers.pop(scheduler_output.step_id, {})
        if set(result.req_ids) != samplers.keys():
            raise RuntimeError(
                f"step {scheduler_output.step_id}: the worker sampled {sorted(result.req_ids)}, "
                f"the scheduler expected {sorted(samplers)}"
            )
        outputs: list[EngineCoreOutput] = []
        accepted = result.draft_logprobs or [[] for _ in result.req_ids]
        for req_id, token_id, logprob, top, draft_logprobs in zip(
            result.req_ids,
            result.sampled_token_ids,
            result.logprobs,
            result.top_logprobs,
            accepted,
            strict=True,
        ):
            request = samplers[req_id]
            if request.status is not RequestStatus.RUNNING or self.requests.get(req_id) is not (
                request
            ):
                continue  # the request finished or was preempted while the step ran
            assert request.num_output_placeholders > 0, f"{req_id} sampled unasked"
            request.num_output_placeholders -= 1
            drafts, request.draft_token_ids = request.draft_token_ids, []
            num_accepted = len(draft_logprobs)
            if drafts:
                self.spec.record(len(drafts), num_accepted)
                # The rejected drafts' KV is computed but wrong: the next steps overwrite it.
                request.num_computed_tokens -= len(drafts) - num_accepted
            new_tokens = []
            for token in [*drafts[:num_accepted], token_id]:
                request.append_output_token_id(token)
                new_tokens.append(token)
                if self._check_stop(request):
                    self.running.remove(request)
                    self._free_request(request)
                    break
            finish_reason, stop_reason = request.finish_reason, request.stop_reason
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_tokens,
                    [*draft_logprobs, logprob][: len(new_tokens)],
                    # Top logprobs for the sampled token only: a request asking for them is
                    # never speculated on (engine/input_checks.py).
                    [*[None] * num_accepted, top][: len(new_tokens)],
                    finish_reason,
                    stop_reason,
                    request.num_cached_tokens,
                )
            )
        return outputs

    def drop_step(self, scheduler_output: SchedulerOutput) -> None:
        """Forget a step whose result will never be applied (it failed on the worker)."""
        self._samplers.pop(scheduler_output.step_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget cached KV (e.g. after a failed step); False while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- helpers ---------------------------------------------------------------------------

    def _check_stop(self, request: Request) -> bool:
        """vLLM's check_stop, stop tokens first: sets the finished status and stop_reason."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if last in request.eos_token_ids and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter runs already, or there is room for one more (the
        workers hold max_loras adapters at once)."""
        if request.lora is None or self.config.max_loras is None:
            return True
        running = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return request.lora.lora_int_id in running or len(running) < self.config.max_loras

    def draft_rooms(self) -> list[tuple[Request, int]]:
        """The decoding requests that may get drafts next step, each with how many at most
        (its limits; the step's budget may cut them): what a draft model proposes for."""
        spec = self.config.speculative
        if spec is None:
            return []
        found = []
        for request in self.running:
            request.proposed_drafts = []  # a proposal is for the step right after it
            if request.num_computed_tokens == request.num_tokens - 1:
                room = self._draft_room(request, spec.num_speculative_tokens + 1)
                if room > 0:
                    found.append((request, room))
        return found

    def _draft_room(self, request: Request, token_budget: int) -> int:
        spec = self.config.speculative
        if spec is None or request.num_output_placeholders:
            return 0
        return min(
            spec.num_speculative_tokens,
            token_budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )

    def _drafts(self, request: Request, token_budget: int) -> list[int]:
        """Speculative decoding: the draft tokens of a decoding request, as many as fit its
        limits and the step's budget beside its own token ([] without speculation): a draft
        model's (proposed before the step), or the request's own n-grams'."""
        spec = self.config.speculative
        room = self._draft_room(request, token_budget)
        if spec is None or room <= 0:
            return []
        if spec.method == "draft_model":
            drafts, request.proposed_drafts = request.proposed_drafts[:room], []
            return drafts
        if request.ngram_index is None:
            request.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return request.ngram_index.propose(request.all_token_ids, room)

    def _preempt(self, request: Request) -> None:
        """Free the request's KV and queue it again (first, under FCFS) to be recomputed."""
        request.draft_token_ids = []
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # results in flight are ignored; it samples anew
        self.waiting.push_preempted(request)
        self.finished_req_ids[request.request_id] = None  # the workers drop its state
        self.num_preemptions += 1

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids[request.request_id] = None

    def _new_request_data(self, request: Request) -> NewRequestData:
        # Snapshot of the lists that keep growing: the message may be read after this step.
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            eos_token_ids=sorted(request.eos_token_ids),
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            token_type_ids=request.token_type_ids,
            lora=request.lora,
        )
