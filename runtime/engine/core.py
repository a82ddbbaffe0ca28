"""EngineCore: the step loop (schedule, execute on the workers, update, stream) and intake.

The loop runs as one task in the Engine's task group, one per data-parallel replica.
"""

from __future__ import annotations

import functools
import logging
from collections import deque

import anyio

from loomllm.clients.workers import WorkerClient
from loomllm.core.request import Request, RequestStatus
from loomllm.core.scheduler import EngineCoreOutput, Scheduler
from loomllm.engine.draft_proposer import DraftProposer
from loomllm.engine.output_processor import OutputProcessor, ParentRequest
from loomllm.errors import EngineClosedError, EngineStepError, RequestRefusedError
from loomllm.metrics.stats import EngineStats
from loomllm.metrics.step_timings import StepClock
from loomllm.protocols.messages import (
    CallFailed,
    ExecuteStep,
    RequestError,
    SchedulerOutput,
    StepResult,
)
from loomllm.protocols.sampling import RequestOutputKind, replace_checked

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the live requests; `run()` is the step loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        workers: WorkerClient,
        output_processor: OutputProcessor,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        *,
        async_scheduling: bool = False,
        ahead_max_rows: int | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.output_processor = output_processor
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.ahead_max_rows = ahead_max_rows
        self.num_steps = 0
        self._clock = StepClock()
        self._work = anyio.Event()
        # (request id, the parent it targets, or None for whichever holds the id by then)
        self._pending_aborts: list[tuple[str, ParentRequest | None]] = []
        # Async scheduling: the last step's results, streamed once the next step is out (see
        # run), or before any abort applies, so that none reaches a request that took the id.
        self._unstreamed: tuple[list[EngineCoreOutput], StepResult] | None = None
        self._idle = anyio.Event()  # set while the loop waits for work
        self.proposer: DraftProposer | None = None  # speculative decoding's draft model
        self._stopped = False  # the loop has ended (its worker died, or the engine closed)
        # Per step in flight: its requests the workers may refuse (RequestError), by id, as
        # they were then: an error must not fail a later request that took the id.
        self._fallible: dict[int, dict[str, Request]] = {}

    # -- intake (sync, any task) -----------------------------------------------------------
    # Intake and aborts only touch the scheduler and wake the loop, so any task may call them.

    def add_request(self, parent: ParentRequest) -> None:
        if self._stopped:  # no loop would ever step it: its stream would wait forever
            raise EngineClosedError("the engine's step loop has ended")
        params = parent.params
        if (
            params.stop
            or params.bad_words
            or params.bad_words_token_ids
            or params.truncate_prompt_tokens is not None
        ):
            # Stop strings are this process's (the output processor's), bad words are
            # encoded and prompts truncated here: never sent to the workers, where one huge
            # or unencodable string would fail every step's frame. Bad-word sequences
            # longer than the context can never complete.
            longest = self.max_model_len
            params = replace_checked(
                params,
                stop=(),
                bad_words=(),
                truncate_prompt_tokens=None,
                bad_words_token_ids=tuple(
                    s for s in params.bad_words_token_ids if len(s) <= longest
                ),
            )
        # Every child's params before any is registered: one that fails leaves nothing behind.
        # (SamplingParams checked seed + n - 1.)
        children = (
            [params]
            if params.n == 1
            else [
                # Children sample independently; seeded ones stay reproducible (vLLM's rule).
                # The prompt is the same for all: child 0 alone scores it (prompt_logprobs).
                replace_checked(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
                for i in range(params.n)
            ]
        )
        for child_id, child_params in zip(self.output_processor.add(parent), children, strict=True):
            self.scheduler.add_request(
                Request(
                    child_id,
                    parent.prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    self.max_model_len,
                    parent.metrics.arrival_time,
                    parent.priority,
                    parent.token_type_ids,
                    parent.lora,
                )
            )
        self._work.set()

    def abort(self, request_id: str, parent: ParentRequest | None = None) -> None:
        """Drop a request before the next step (its KV blocks are freed then).

        Only queues the id: it may be called from a finalizer, in the middle of anything.
        `parent`: abort only that request, not a later one that took its id (a stream
        closed after its request finished, or collected much later, must not end it).
        """
        self._pending_aborts.append((request_id, parent))
        self._work.set()

    def abort_all(self) -> None:
        """End every live request now with finish_reason "abort" (a server's drain deadline).

        The streams end and the KV blocks are free at once (a step in flight has its
        results for them ignored, as for any finished request).
        """
        self._stream_unstreamed()  # what finished at the last step ends as it did
        children = [c for p in self.output_processor.parents.values() for c in p.child_ids()]
        self.output_processor.abort_all()
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
        self._work.set()

    def _abort_now(self, request_id: str, finish_reason: str = "abort") -> None:
        child_ids = self.output_processor.remove(request_id, finish_reason)
        if child_ids:
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    async def wait_until_idle(self) -> None:
        """Wait until no request is left and every abort has been applied, or the loop ended."""
        while not self._stopped and (
            self._pending_aborts or self._work.is_set() or not self._idle.is_set()
        ):
            if self._idle.is_set():
                await anyio.lowlevel.checkpoint()  # the loop has yet to see the new work
            else:
                await self._idle.wait()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        m = self.output_processor.metrics
        spec = self.scheduler.spec
        return EngineStats(
            self.scheduler.num_running,
            self.scheduler.num_waiting,
            kv.num_free_blocks,
            kv.num_total_blocks,
            kv.prefix_cache_hit_rate,
            self.num_steps,
            self.scheduler.num_preemptions,
            m.num_prompt_tokens,
            m.num_generation_tokens,
            dict(m.num_finished),
            m.time_to_first_token.snapshot(),
            m.inter_token_latency.snapshot(),
            m.e2e_request_latency.snapshot(),
            self._clock.snapshot(),
            kv.prefix_cache_queries,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos),
        )

    # -- the step loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Step until cancelled; on the way out every open stream ends (abort or error).

        One step in flight, or two with async scheduling: step N+1 is scheduled and sent
        while step N runs (its sampled tokens are placeholders here; the worker has them),
        so the engine's own work (update, outputs, schedule) overlaps the forward. Then a
        step's outputs are streamed only after the next step is sent: between a reply and the
        next send (what a worker waits for) the engine only updates and schedules. A stop
        string is seen a step later for it: the request computes two dropped tokens, not one.
        With `ahead_max_rows`, a step of more requests runs alone, unless every output in it is
        whole: the loop takes its reply before it schedules again.
        """
        error: BaseException | None = None
        in_flight: deque[tuple[SchedulerOutput, int]] = deque()  # (step, call id), oldest first
        depth = 2 if self.async_scheduling else 1
        sent_ahead = False  # the last turn sent a step and went on: its timing continues
        try:
            while True:
                if self._pending_aborts:
                    self._stream_unstreamed()
                while self._pending_aborts:
                    request_id, parent = self._pending_aborts.pop()
                    holder = self.output_processor.parents.get(request_id)
                    if parent is None or holder is parent:
                        self._abort_now(request_id)
                if not sent_ahead:
                    self._clock.start()
                sent_ahead = False
                if self.proposer is not None:  # a draft model drafts before the step
                    await self.proposer.propose(self.scheduler.draft_rooms())
                scheduler_output = self.scheduler.schedule()
                self._note_fallible(scheduler_output)  # before an await lets an abort in
                has_work = bool(
                    scheduler_output.num_scheduled_tokens or scheduler_output.finished_req_ids
                )
                if not has_work and not in_flight:
                    self._clock.idle()
                    self._idle.set()
                    await self._work.wait()
                    self._work = anyio.Event()
                    self._idle = anyio.Event()
                    continue
                self._clock.scheduled()  # only steps count: an idle turn charges nothing
                if has_work:
                    call_id = await self.workers.submit(
                        functools.partial(_execute_step, scheduler_output=scheduler_output),
                        on_encoded=self._clock.encoded,
                    )
                    self._clock.sent()
                    in_flight.append((scheduler_output, call_id))
                else:
                    self._clock.encoded()
                self._stream_held()
                if has_work and len(in_flight) < depth and self._may_run_ahead(scheduler_output):
                    sent_ahead = True
                    continue  # the next step goes out before this one's result is in
                await self._collect_oldest(in_flight)
                self._clock.finish()
                if in_flight and not self._may_run_ahead(in_flight[-1][0]):
                    # The step sent last may not overlap the engine's own work: its reply is
                    # taken too, in a turn of its own, before the loop schedules again.
                    self._clock.start()
                    self._clock.scheduled()
                    self._clock.encoded()
                    self._stream_held()
                    await self._collect_oldest(in_flight)
                    self._clock.finish()
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else None
            raise
        finally:
            for _, call_id in in_flight:
                self.workers.discard(call_id)
            self._unstreamed = None
            self._fallible.clear()
            # An ended loop holds nothing: its streams end, its requests free their blocks.
            self.output_processor.abort_all(error)
            self.scheduler.finish_requests(
                list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED
            )
            self._stopped = True
            self._idle.set()  # wakes wait_until_idle: nothing will run here any more

    async def _collect_oldest(self, in_flight: deque[tuple[SchedulerOutput, int]]) -> None:
        """Take the oldest step's reply: update the scheduler and stream its outputs (or hold
        them back while a step is still in flight); a failed step fails its requests."""
        step, call_id = in_flight.popleft()
        reply = (await self.workers.collect(call_id))[0]
        self._clock.replied(reply.worker_time_s if isinstance(reply, StepResult) else 0.0)
        self.num_steps += 1
        if isinstance(reply, CallFailed):
            self._fallible.clear()  # every running request fails or is drained
            self.scheduler.drop_step(step)
            self._fail_running(reply)
            await self._drain(in_flight)
            self._clock.idle()  # the drain's wait is no turnaround
        else:
            assert isinstance(reply, StepResult)
            fallible = self._fallible.pop(step.step_id, {})
            if reply.request_errors:  # first, so that the update drops their tokens
                self._fail_requests(reply.request_errors, fallible)
            outputs = self.scheduler.update_from_output(step, reply)
            self._clock.updated()
            # Held back only while a step is in flight, so that the turn which streams
            # them always has a reply to wait for.
            if in_flight:
                self._unstreamed = (outputs, reply)
            else:
                self._stream(outputs, reply)

    async def _drain(self, in_flight: deque[tuple[SchedulerOutput, int]]) -> None:
        """After a failed step: wait out the step sent behind it (async scheduling).

        The worker dropped its batch, so that step failed too or computed requests that
        `_fail_running` has ended already: its reply changes nothing (and the blocks it
        hashed left the prefix cache with the failed step's).
        """
        while in_flight:
            step, call_id = in_flight.popleft()
            await self.workers.collect(call_id)
            self.scheduler.drop_step(step)

    def _may_run_ahead(self, step: SchedulerOutput) -> bool:
        """Whether the loop may schedule the next step while `step` runs (async scheduling):
        always, or while steps have at most `ahead_max_rows` requests, or hold only requests
        whose outputs are whole (FINAL_ONLY, as LLM.generate's): for those the engine between
        steps only updates and schedules, with no output streamed a token at a time."""
        if self.ahead_max_rows is None or len(step.num_scheduled_tokens) <= self.ahead_max_rows:
            return True
        requests = self.scheduler.requests
        whole = RequestOutputKind.FINAL_ONLY
        return all(
            (request := requests.get(req_id)) is not None
            and request.sampling_params.output_kind is whole
            for req_id in step.num_scheduled_tokens
        )

    def _stream_held(self) -> None:
        """Stream the held outputs, if any, on the step clock's output phase."""
        if self._unstreamed is not None:
            self._clock.stream_began()
            self._stream_unstreamed()
            self._clock.streamed()

    def _stream_unstreamed(self) -> None:
        if self._unstreamed is not None:
            unstreamed, self._unstreamed = self._unstreamed, None
            self._stream(*unstreamed)

    def _stream(self, outputs: list[EngineCoreOutput], reply: StepResult) -> None:
        """A step's results to the request streams; a stop string found finishes its request."""
        self.output_processor.add_prompt_logprobs(reply.prompt_logprobs)
        self.output_processor.add_pooled(reply.pooled)
        stopped = self.output_processor.process(outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def _note_fallible(self, step: SchedulerOutput) -> None:
        """Remember the step's requests that the workers may refuse (see `_fail_requests`)."""
        requests = self.scheduler.requests
        fallible = {
            req_id: request
            for req_id in step.num_scheduled_tokens
            if (params := (request := requests[req_id]).sampling_params).structured_outputs
            or params.allowed_token_ids is not None
            or request.lora is not None  # an adapter that cannot load
        }
        if fallible:
            self._fallible[step.step_id] = fallible

    def _fail_requests(self, errors: list[RequestError], fallible: dict[str, Request]) -> None:
        """Requests the workers could not serve (a grammar that does not compile, nothing
        left to sample, a LoRA adapter that does not load) fail alone: RequestRefusedError on
        their streams."""
        # The previous step's outputs for these requests are valid: stream them first.
        self._stream_unstreamed()
        for error in errors:
            request = fallible.get(error.req_id)
            state = self.output_processor.states.get(error.req_id)
            if request is None or self.scheduler.requests.get(error.req_id) is not request:
                continue  # it ended meanwhile, and its id may belong to a new request now
            if state is None:
                continue  # it failed already with a sibling (n > 1)
            request_id = state.parent.request_id
            logger.info("request %s refused by the workers: %s", request_id, error.message)
            refused = RequestRefusedError(error.message)
            self.output_processor.parents[request_id].collector.put(refused)
            self._abort_now(request_id, "error")

    def _fail_running(self, failed: CallFailed) -> None:
        """The worker raised in a step and dropped its batch: fail what it held, keep the rest."""
        logger.error("step failed on the worker: %s: %s", failed.error_type, failed.message)
        error = EngineStepError(f"{failed.error_type}: {failed.message}")
        held = {r.request_id for r in self.scheduler.running}
        parents = {
            state.parent.request_id
            for child_id, state in self.output_processor.states.items()
            if child_id in held
        }
        for request_id in parents:
            self.output_processor.parents[request_id].collector.put(error)
            self._abort_now(request_id, "error")
        # Blocks hashed for that step never got their KV: no later request may hit them.
        self.scheduler.reset_prefix_cache()
        self._work.set()


def _execute_step(call_id: int, scheduler_output: SchedulerOutput) -> ExecuteStep:
    return ExecuteStep(call_id, scheduler_output)
