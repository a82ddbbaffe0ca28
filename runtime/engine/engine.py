"""Engine: the user's handle on a model, one anyio task group in the caller's event loop.

It gets workers from the engine-manager and hands each request to a replica's step loop.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TypeVar

import anyio
import cloudpickle

from loomllm.clients import hub
from loomllm.clients.manager import (
    ManagerClient,
    PrivateManager,
    connect_manager,
    connect_shared_manager,
)
from loomllm.config import EngineConfig, SpeculativeConfig
from loomllm.engine.draft_proposer import DraftProposer
from loomllm.engine.exception_groups import simplest
from loomllm.engine.generation_defaults import sampling_defaults
from loomllm.engine.input_checks import (
    check_lora,
    check_priority,
    check_request_id,
    check_room,
    check_speculable,
    check_token_ids,
    prompt_token_ids,
    segments_of,
    with_bad_words_encoded,
)
from loomllm.engine.output_processor import ParentRequest
from loomllm.engine.pooling_requests import PoolingRequests
from loomllm.engine.replica import Replica, least_loaded
from loomllm.engine.request_stream import RequestStream
from loomllm.errors import EngineClosedError, EngineDeadError, RemoteCallError
from loomllm.metrics.stats import EngineStats, merge_stats
from loomllm.outputs import (
    RequestMetrics,
    RequestOutputCollector,
)
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.messages import (
    CallFailed,
    CallResult,
    ModelInfo,
    PullProgress,
    RunCallable,
    WorkerDied,
    WorkersAcquired,
)
from loomllm.protocols.rundir import default_socket_path
from loomllm.protocols.sampling import SamplingParams
from loomllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Engine(PoolingRequests):
    """An LLM engine whose model runs in worker processes owned by the engine-manager.

    `async with` connects to (or starts) the manager and attaches to warm workers or has new
    ones launched; leaving the block releases them, warm for `keep_alive` seconds. A dead
    worker fails the engine with EngineDeadError. With `data_parallel_size=N` it runs N
    replicas (runtime/engine/replica.py), each with its own workers, scheduler and KV cache;
    a request goes to the least loaded one, and a dead replica fails only its own requests.
    """

    def __init__(self, model: str = "smollm2", **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        self.engine_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._stack: AsyncExitStack | None = None
        self._replicas: list[Replica] = []
        self._manager: ManagerClient | None = None  # set while the engine runs
        self._running = False
        self._turn = itertools.count()  # round-robin among equally loaded replicas
        self.tokenizer: Tokenizer | None = None
        # The model's sampling defaults (generation_config), for requests without params.
        self.sampling_defaults: dict[str, Any] = {}
        self._release_keep_alive: float | None = None  # set_keep_alive's, once called

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
                raise simplest(eg) from None
            raise
        self._running = True
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """Cancellation: its cleanup steps are shielded; workers are released on return."""
        assert self._stack is not None
        # First: a generate() from another task while the engine closes is refused, not
        # added to a step loop that is ending (its stream would wait forever).
        self._running = False
        try:
            return await self._stack.__aexit__(et, e, tb)
        except BaseExceptionGroup as eg:
            raise simplest(eg) from None

    async def _start(self, stack: AsyncExitStack) -> None:
        cfg = self.config
        if cfg.manager == "private":
            private = await stack.enter_async_context(PrivateManager())
            ms = await connect_manager(private.socket_path)
        else:
            ms = await connect_shared_manager(cfg.manager_socket or default_socket_path())
        manager = self._manager = ManagerClient(ms, self._on_worker_died)
        stack.push_async_callback(manager.aclose)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)  # runs after release, before the group exits
        # Readers end by their stream closing, not by cancellation: anyio's asyncio Unix
        # socket can fail a read cancelled just as data arrives ("invalid state").
        stack.push_async_callback(manager.aclose)
        await tg.start(manager.run)
        if hub.is_hub_id(cfg.model) and not hub.offline():
            # Where the workers run, before they are asked for: they load from the HF cache.
            await hub.pull(manager, cfg.model, cfg.revision)
        num_replicas = cfg.data_parallel_size
        for index in range(num_replicas):
            engine_id = self.engine_id if num_replicas == 1 else f"{self.engine_id}/dp{index}"
            replica = Replica(index, cfg, engine_id, self._on_replica_death)
            replica.release_keep_alive = self._release_keep_alive
            self._replicas.append(replica)
            # One at a time: the manager answers one engine's requests in order anyway.
            await replica.start(stack, tg, manager, self.tokenizer)
            assert replica.core is not None and replica.acquired is not None
            self.tokenizer = replica.core.output_processor.tokenizer
            if index == 0:
                self.sampling_defaults = sampling_defaults(
                    cfg.generation_config, replica.acquired.model_info.model_dir
                )
            logger.info(
                "engine %s attached to %s workers %s (%s)",
                engine_id,
                "warm" if replica.acquired.reused else "new",
                replica.acquired.pids,
                cfg.model,
            )
        spec = cfg.speculative
        if spec is not None and spec.method == "draft_model":
            await self._start_draft_model(stack, spec)
        _freeze_heap()
        stack.callback(_thaw_heap)

    async def _start_draft_model(self, stack: AsyncExitStack, spec: SpeculativeConfig) -> None:
        """The draft model's engine, on the same manager, closed before this one's replicas."""
        cfg = self.config
        assert spec.model is not None
        # Its worker sizes after the target's, filling the share the target left it.
        options: dict[str, Any] = {
            "dtype": cfg.dtype,
            "max_num_seqs": cfg.max_num_seqs,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
        }
        options.update(spec.draft_options)
        draft = Engine(
            spec.model,
            manager=cfg.manager,
            manager_socket=cfg.manager_socket,
            seed=cfg.seed,
            keep_alive=cfg.keep_alive,
            **options,
        )
        await stack.enter_async_context(draft)
        if draft.model_info.vocab_size != self.model_info.vocab_size:
            raise ValueError(
                f"speculative_config model {spec.model!r} has a vocabulary of "
                f"{draft.model_info.vocab_size}, the target {self.model_info.vocab_size}: a "
                "draft model must share the target's tokenizer"
            )
        proposer = DraftProposer(draft)
        for replica in self._replicas:
            assert replica.core is not None
            replica.core.proposer = proposer

    def set_keep_alive(self, seconds: float) -> None:
        """Seconds the workers stay warm once this engine closes, in place of the config's
        `keep_alive` (-1: pinned; 0: stopped as the engine closes, their memory freed)."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(f"keep_alive must be a number of seconds, got {seconds!r}")
        if not (seconds >= 0 or seconds == -1):
            raise ValueError(f"keep_alive must be seconds >= 0, or -1 to pin, got {seconds!r}")
        self._release_keep_alive = -1 if seconds == math.inf else float(seconds)
        for replica in self._replicas:
            replica.release_keep_alive = self._release_keep_alive

    # -- worker death -----------------------------------------------------------------

    def _on_worker_died(self, report: WorkerDied) -> None:
        for replica in self._replicas:
            if replica.acquired is not None and replica.acquired.group_id == report.group_id:
                replica.on_worker_died(report)

    def _on_replica_death(self, replica: Replica) -> bool:
        """A replica lost a rank: the engine goes on while another one lives."""
        live = [r for r in self._replicas if r.is_alive]
        if live:
            logger.error(
                "data-parallel replica %d died (%s); %d of %d replicas go on",
                replica.index,
                replica.dead,
                len(live),
                len(self._replicas),
            )
        return bool(live)

    # -- calls ------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._require_acquired()[0].model_info

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have (the model's, within the KV cache)."""
        self._require_running()
        return min(r.core.max_model_len for r in self._replicas if r.core is not None)

    @property
    def worker_pids(self) -> list[int]:
        """Every rank's pid, replica by replica."""
        return [pid for acquired in self._require_acquired() for pid in acquired.pids]

    @property
    def reused_warm_workers(self) -> bool:
        """True when this engine attached to already-loaded workers (every replica)."""
        return all(acquired.reused for acquired in self._require_acquired())

    async def collective_rpc(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run `fn(worker, *args, **kwargs)` on every rank; return the results in rank order
        (replica by replica with data parallelism; a dead replica raises EngineDeadError).

        `fn` and its arguments are sent with cloudpickle over each rank's data connection
        (a local socket; TCP to a Ray rank).
        Cancellation: the ranks still run the call; its results are discarded.
        """
        self._require_running()
        payload = cloudpickle.dumps((fn, args, kwargs))
        results: list[Any] = []
        for replica in self._replicas:
            assert replica.workers is not None
            replies = await replica.workers.call(lambda call_id: RunCallable(call_id, payload))
            for reply in replies:
                if isinstance(reply, CallFailed):  # len(results) is the failed rank's index
                    raise RemoteCallError(
                        len(results), reply.error_type, reply.message, reply.traceback
                    )
                assert isinstance(reply, CallResult)
                results.append(cloudpickle.loads(reply.payload))
        return results

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        max_tokens_must_fit: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Start one request and return its stream of outputs (`async for out in ...`).

        `prompt` is a string or {"prompt_token_ids": [...]}. Bad input raises ValueError
        naming the field here, before anything is scheduled. Leaving the stream (break,
        cancellation, a deadline, `aclose()`) aborts the request; its KV blocks are free
        again before the next step. `priority` (scheduling_policy="priority" only): lower
        runs first, and is preempted last. `max_tokens_must_fit`: refuse a request whose
        prompt and max_tokens pass max_model_len, as the OpenAI API does (by default its
        output stops where the context is full). `lora_request` (enable_lora=True): the LoRA
        adapter it runs with; None: the base model.
        """
        self._require_running()
        if self.model_info.pooling is not None:
            raise ValueError(
                "this engine runs with runner='pooling': it embeds (Engine.embed), it does "
                "not generate"
            )
        params = (
            sampling_params if sampling_params is not None else (self.default_sampling_params())
        )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
        return self._submit(prompt, params, request_id, priority, max_tokens_must_fit, lora_request)

    async def pull(
        self,
        model: str,
        revision: str | None = None,
        on_progress: Callable[[PullProgress], None] = lambda report: None,
    ) -> str:
        """Have the engine's manager download hub model `model` (Ollama's pull: any model,
        not only this engine's), asking the Hub for a newer commit; its snapshot folder.
        ModelPullError with the manager's words where it cannot."""
        self._require_running()
        if not hub.is_hub_id(model):
            raise ValueError(f"model {model!r} is not a hub id like 'org/name'")
        assert self._manager is not None
        token = os.environ.get("HF_TOKEN") or None
        pulled = await self._manager.pull(model, revision, token, on_progress, check_hub=True)
        return pulled.path

    def _submit(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str | None,
        priority: int,
        max_tokens_must_fit: bool,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        check_priority(priority, self.config.scheduling_policy)
        check_lora(lora_request, self.config)
        tokenizer = self.tokenizer
        assert tokenizer is not None
        vocab = self.model_info.vocab_size
        params = with_bad_words_encoded(params, tokenizer)
        check_token_ids(params, vocab, tokenizer.eos_token_ids)
        if self.config.speculative_config is not None:
            check_speculable(params)
        text, token_ids = prompt_token_ids(prompt, tokenizer, vocab, self.max_model_len, params)
        token_type_ids = segments_of(prompt, token_ids, self.model_info.pooling, params)
        if max_tokens_must_fit:
            check_room(len(token_ids), params, self.max_model_len)
        request_id = check_request_id(uuid.uuid4().hex if request_id is None else request_id)
        if self.replica_index(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already running")
        live = self._live_replicas()
        if not live:  # the engine is on its way out: its task group has the error
            dead = [str(r.dead or "its worker's connection broke") for r in self._replicas]
            raise EngineDeadError(
                dead[0] if len(dead) == 1 else f"every replica's worker died: {'; '.join(dead)}"
            )
        core = least_loaded(live, next(self._turn)).core
        assert core is not None
        parent = ParentRequest(
            request_id,
            text,
            token_ids,
            params,
            RequestOutputCollector(params.output_kind),
            RequestMetrics(arrival_time=time.time()),
            priority=priority,
            token_type_ids=token_type_ids,
            lora=lora_request,
        )
        core.add_request(parent)
        # The stream aborts its own request only: never a later one that reuses the id.
        return RequestStream(
            request_id, parent.collector, functools.partial(core.abort, parent=parent)
        )

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (generation_config, as vLLM's LLM
        .get_default_sampling_params()): what generate() and chat() use without params."""
        return SamplingParams(**self.sampling_defaults)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        priority: int = 0,
        max_tokens_must_fit: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Apply the model's chat template to `messages`, then stream like generate().

        `chat_template`: a template string, or the name of one of the model's, instead of
        its default; `chat_template_kwargs`: variables for the template (vLLM's names).
        `continue_final_message` (with add_generation_prompt=False): the model goes on with
        the final message's text (a prefilled assistant answer) instead of starting a new one.
        """
        self._require_running()
        assert self.tokenizer is not None
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(
            {"prompt_token_ids": ids, "prompt": text},
            sampling_params,
            request_id=request_id,
            priority=priority,
            max_tokens_must_fit=max_tokens_must_fit,
            lora_request=lora_request,
        )

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if it already finished)."""
        self._require_running()
        index = self.replica_index(request_id)
        if index is not None:
            core = self._replicas[index].core
            assert core is not None
            core.abort(request_id)

    def abort_all(self) -> None:
        """Abort every running request: each open stream ends with finish_reason "abort"."""
        for replica in self._live_replicas():
            assert replica.core is not None
            replica.core.abort_all()

    def replica_index(self, request_id: str) -> int | None:
        """The data-parallel replica that runs the request, or None if none does (now)."""
        for replica in self._live_replicas():
            assert replica.core is not None
            if request_id in replica.core.output_processor.parents:
                return replica.index
        return None

    async def wait_until_idle(self) -> None:
        """Wait until the engine has no request left (drain before shutdown, tests).

        Cancellation: nothing to undo.
        """
        for replica in self._live_replicas():
            assert replica.core is not None
            await replica.core.wait_until_idle()

    def stats(self) -> EngineStats:
        """Running/waiting counts, KV blocks, prefix-cache hit rate, steps and their timings:
        all replicas together, each one's in `replicas` when there are several."""
        self._require_running()
        return merge_stats([replica.stats() for replica in self._replicas])

    def _require_running(self) -> None:
        if not self._running:
            # An engine that ended because its worker died says so, not "not running".
            for replica in self._replicas:
                if replica.dead is not None:
                    raise EngineDeadError(str(replica.dead))
            raise EngineClosedError("the engine is not running: use `async with Engine(...)`")

    def _live_replicas(self) -> list[Replica]:
        """Every replica but those whose worker died."""
        self._require_running()
        return [r for r in self._replicas if r.is_alive]

    def _require_acquired(self) -> list[WorkersAcquired]:
        acquired = [r.acquired for r in self._replicas if r.acquired is not None]
        if not acquired:
            raise EngineClosedError("the engine has not started: use `async with Engine(...)`")
        return acquired


_heap_lock = threading.Lock()
_engines_frozen = 0  # running engines in this process, which froze its heap


def _freeze_heap() -> None:
    """Freeze the heap once an engine is attached (its imports, the tokenizer, the engine).

    Full collections then stop scanning those objects, which would otherwise stall a step now
    and then; vLLM's engine core freezes its heap too. Refcounting still frees frozen objects;
    only their cycles wait for the last engine's exit to unfreeze (which also ends a freeze of
    the caller's own: the price of sharing gc). Unlike vLLM, no gc.collect() first: it would
    slow every start, and cycles that are garbage already just wait for that exit too."""
    global _engines_frozen
    with _heap_lock:
        _engines_frozen += 1
        gc.freeze()


def _thaw_heap() -> None:
    global _engines_frozen
    with _heap_lock:
        _engines_frozen -= 1
        if not _engines_frozen:
            gc.unfreeze()
