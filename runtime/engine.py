"""Engine: the user's handle on a model, one anyio task group in the caller's event loop.

`async with Engine("smollm2") as e:` connects to (or starts) the engine-manager, attaches
to warm workers or has new ones launched, and holds its connections and reader tasks in
one task group. Leaving the block closes them all; the workers stay warm for
`keep_alive` seconds. A dead worker fails the engine with EngineDeadError, promptly.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TypeVar

import anyio
import cloudpickle

from protocols.messages import CallFailed, ModelInfo, RunCallable, WorkerDied, WorkersAcquired
from protocols.rundir import default_socket_path
from protocols.sampling import SamplingParams
from runtime.config import EngineConfig
from runtime.engine_core import EngineCore, EngineStats
from runtime.engine_setup import build_engine_core
from runtime.errors import EngineClosedError, EngineDeadError, ManagerError, RemoteCallError
from runtime.manager_client import (
    ManagerClient,
    PrivateManager,
    connect_manager,
    connect_shared_manager,
)
from runtime.output_processor import ParentRequest
from runtime.outputs import RequestMetrics, RequestOutputCollector
from runtime.request_stream import RequestStream
from runtime.tokenizer import Tokenizer
from runtime.worker_client import WorkerClient

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long a broken worker connection waits for the manager's report of why.
DEATH_REPORT_WAIT_S = 0.5


class Engine:
    """An LLM engine whose model runs in worker processes owned by the engine-manager."""

    def __init__(self, model: str = "smollm2", **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        self.engine_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._stack: AsyncExitStack | None = None
        self._workers: WorkerClient | None = None
        self._core: EngineCore | None = None
        self.tokenizer: Tokenizer | None = None
        self._acquired: WorkersAcquired | None = None
        self._lost = anyio.Event()
        self._lost_reason = ""
        self._death_report: WorkerDied | None = None
        self._death_reported = anyio.Event()

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._stack is not None:
            raise RuntimeError("an Engine can be entered only once; create a new one")
        self._stack = AsyncExitStack()
        try:
            await self._start(self._stack)
        except BaseException as exc:
            try:
                await self._stack.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseExceptionGroup as eg:
                raise _simplest(eg) from None
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """Cancellation: its cleanup steps are shielded; workers are released on return."""
        assert self._stack is not None
        try:
            return await self._stack.__aexit__(et, e, tb)
        except BaseExceptionGroup as eg:
            raise _simplest(eg) from None
        finally:
            self._workers = self._core = None

    async def _start(self, stack: AsyncExitStack) -> None:
        cfg = self.config
        if cfg.manager == "private":
            private = await stack.enter_async_context(PrivateManager())
            ms = await connect_manager(private.socket_path)
        else:
            ms = await connect_shared_manager(cfg.manager_socket or default_socket_path())
        manager = ManagerClient(ms, self._on_worker_died)
        stack.push_async_callback(manager.aclose)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)  # runs after release, before the group exits
        # Readers end by their stream closing, not by cancellation: anyio's asyncio Unix
        # socket can fail a read cancelled just as data arrives ("invalid state").
        stack.push_async_callback(manager.aclose)
        await tg.start(manager.run)
        self._acquired = await manager.acquire(cfg.worker_spec(), cfg.keep_alive, self.engine_id)
        stack.push_async_callback(self._release, manager, self._acquired.group_id)
        workers = await WorkerClient.connect(self._acquired.sockets, self._acquired.lease_token)
        stack.push_async_callback(workers.aclose)
        workers.start_readers(tg, self._on_rank_lost)
        tg.start_soon(self._watch_for_death, workers)
        self._workers = workers
        self._core = build_engine_core(cfg, self._acquired.model_info, workers)
        self.tokenizer = self._core.output_processor.tokenizer
        core_scope, core_done = anyio.CancelScope(), anyio.Event()

        async def run_core(core: EngineCore) -> None:
            try:
                with core_scope:
                    await core.run()
            finally:
                core_done.set()

        async def stop_core() -> None:
            # First on the way out: a step still in flight (the one that tells the worker
            # about the last finished requests, say) must end before the worker sockets
            # close, or it would fail as a dead worker and raise from __aexit__.
            core_scope.cancel()
            with anyio.CancelScope(shield=True):
                await core_done.wait()

        tg.start_soon(run_core, self._core)
        stack.push_async_callback(stop_core)
        logger.info(
            "engine %s attached to %s workers %s (%s)", self.engine_id,
            "warm" if self._acquired.reused else "new", self._acquired.pids, cfg.model,
        )  # fmt: skip

    async def _release(self, manager: ManagerClient, group_id: str) -> None:
        if self._lost.is_set():
            return  # the manager tears a broken group down itself
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(5):
                await manager.release(group_id)
        except (ManagerError, OSError, anyio.BrokenResourceError, TimeoutError) as exc:
            # Closing our connection releases the workers too; this was the polite way.
            logger.warning("could not release workers cleanly: %s", exc)

    # -- worker death -----------------------------------------------------------------

    def _on_worker_died(self, report: WorkerDied) -> None:
        self._death_report = report
        self._death_reported.set()
        self._on_rank_lost(report.rank, "the engine-manager reported its death")

    def _on_rank_lost(self, rank: int, why: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = why
            self._lost.set()

    async def _watch_for_death(self, workers: WorkerClient) -> None:
        await self._lost.wait()
        with anyio.move_on_after(DEATH_REPORT_WAIT_S):
            await self._death_reported.wait()
        error = EngineDeadError(self._death_reason())
        workers.fail(error)
        raise error

    def _death_reason(self) -> str:
        report = self._death_report
        if report is None:
            return f"engine lost its worker: {self._lost_reason}"
        how = (
            f"killed by signal {signal.Signals(report.signal).name}"
            if report.signal is not None
            else f"exited with code {report.exit_code}"
        )
        tail = report.stderr_tail.strip()
        return f"worker rank {report.rank} (pid {report.pid}) {how}" + (
            f"; its stderr ended with:\n{tail}" if tail else ""
        )

    # -- calls ------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._require_acquired().model_info

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have (the model's, within the KV cache)."""
        return self._require_core().max_model_len

    @property
    def worker_pids(self) -> list[int]:
        return list(self._require_acquired().pids)

    @property
    def reused_warm_workers(self) -> bool:
        """True when this engine attached to already-loaded workers."""
        return self._require_acquired().reused

    async def collective_rpc(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run `fn(worker, *args, **kwargs)` on every rank; return the results in rank order.

        `fn` and its arguments are sent with cloudpickle over the local socket.
        Cancellation: the ranks still run the call; its results are discarded.
        """
        if self._workers is None:
            raise EngineClosedError("the engine is not running: use `async with Engine(...)`")
        payload = cloudpickle.dumps((fn, args, kwargs))
        replies = await self._workers.call(lambda call_id: RunCallable(call_id, payload))
        results = []
        for rank, reply in enumerate(replies):
            if isinstance(reply, CallFailed):
                raise RemoteCallError(rank, reply.error_type, reply.message, reply.traceback)
            results.append(cloudpickle.loads(reply.payload))
        return results

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Start one request and return its stream of outputs (`async for out in ...`).

        `prompt` is a string or {"prompt_token_ids": [...]}. Bad input raises ValueError
        naming the field here, before anything is scheduled. Leaving the stream (break,
        cancellation, a deadline, `aclose()`) aborts the request; its KV blocks are free
        again before the next step.
        """
        core = self._require_core()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
        text, token_ids = self._prompt_tokens(prompt)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in core.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already running")
        parent = ParentRequest(
            request_id, text, token_ids, params, RequestOutputCollector(params.output_kind),
            RequestMetrics(arrival_time=time.time()),
        )  # fmt: skip
        core.add_request(parent)
        return RequestStream(request_id, parent.collector, core.abort)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Apply the model's chat template to `messages`, then stream like generate()."""
        self._require_core()
        assert self.tokenizer is not None
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(
            {"prompt_token_ids": ids, "prompt": text}, sampling_params, request_id=request_id
        )

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if it already finished)."""
        self._require_core().abort(request_id)

    def abort_all(self) -> None:
        """Abort every running request: each open stream ends with finish_reason "abort"."""
        self._require_core().abort_all()

    async def wait_until_idle(self) -> None:
        """Wait until the engine has no request left (drain before shutdown, tests).

        Cancellation: nothing to undo.
        """
        await self._require_core().wait_until_idle()

    def stats(self) -> EngineStats:
        """Running/waiting counts, KV blocks, prefix-cache hit rate, steps and their timings."""
        return self._require_core().stats()

    def _prompt_tokens(self, prompt: str | dict[str, Any]) -> tuple[str | None, list[int]]:
        core = self._require_core()
        assert self.tokenizer is not None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            vocab = self.model_info.vocab_size
            if not isinstance(ids, list) or not all(
                type(t) is int and 0 <= t < vocab for t in ids
            ):
                raise ValueError(f"prompt_token_ids must be a list of token ids in [0, {vocab})")
        else:
            raise ValueError('prompt must be a string or {"prompt_token_ids": [...]}')
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= core.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
                f"({core.max_model_len}) to leave room for output"
            )
        return text, list(ids)

    def _require_core(self) -> EngineCore:
        if self._core is None:
            raise EngineClosedError("the engine is not running: use `async with Engine(...)`")
        return self._core

    def _require_acquired(self) -> WorkersAcquired:
        if self._acquired is None:
            raise EngineClosedError("the engine has not started: use `async with Engine(...)`")
        return self._acquired


def _simplest(eg: BaseExceptionGroup) -> BaseException:
    """The exception a user should see: the engine's death first, else a lone error."""
    leaves = list(_leaves(eg))
    for leaf in leaves:
        if isinstance(leaf, EngineDeadError):
            return leaf
    return leaves[0] if len(leaves) == 1 else eg


def _leaves(eg: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in eg.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
