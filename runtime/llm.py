"""LLM: the blocking facade over Engine, for scripts, notebook cells and threads.

The Engine runs in an event loop on a thread of its own, so it works where a loop already runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal
from tqdm.auto import tqdm

from loomllm.engine.engine import Engine
from loomllm.engine.exception_groups import simplest
from loomllm.engine.request_stream import RequestStream
from loomllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from loomllm.protocols.lora import LoRARequest
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams
from loomllm.text.tokenizer import Tokenizer

Prompt = str | dict[str, Any]
T = TypeVar("T")

# How long an interrupted call waits for its cancelled task (its requests' aborts) to end.
CANCEL_WAIT_S = 10.0


class LLM:
    """`LLM("smollm2").generate(prompts, params)` -> outputs in input order."""

    def __init__(self, model: str = "smollm2", **options: Any) -> None:
        self.engine = Engine(model, **options)
        self._portal: BlockingPortal | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="loomllm-LLM", daemon=True
        )
        self._thread.start()
        ready.wait()
        assert self._portal is not None
        self._engine_cm = self._portal.wrap_async_context_manager(self.engine)
        try:
            self._engine_cm.__enter__()
        except BaseException:
            self._stop_portal()
            raise
        # A program that forgets close() still exits: this finalizer (at exit at the latest)
        # returns the workers to the manager, warm, and stops the loop thread.
        self._closer: weakref.finalize[Any, Any] = weakref.finalize(
            self, LLM._close_parts, self._engine_cm, self._portal, self._thread
        )
        atexit.register(self._closer)

    def _serve(self, ready: threading.Event) -> None:
        async def main() -> None:
            async with BlockingPortal() as portal:
                self._portal = portal
                ready.set()
                await portal.sleep_until_stopped()

        anyio.run(main)

    # -- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the engine; results in input order.

        `priority`: one for all prompts or one each (scheduling_policy="priority");
        `lora_request`: likewise, the LoRA adapter each prompt runs with (enable_lora)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts), self.engine)
        calls = _calls(self.engine.generate, prompts, params, priority, lora_request)
        return self._run(calls, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; answers in input order.

        The keyword arguments are Engine.chat's; `priority` as in generate()."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _per_prompt(sampling_params, len(conversations), self.engine)
        chat = partial(
            self.engine.chat,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        calls = _calls(chat, conversations, params, priority, lora_request)
        return self._run(calls, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (runner="pooling"), batched by the engine; in input order.
        The keyword arguments are Engine.embed's."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        start = partial(
            self.engine.embed_stream,
            dimensions=dimensions,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        calls = [(lambda prompt, _: start(prompt), p, None) for p in prompts]
        finals = self._run(calls, use_tqdm)
        return [self.engine.embedding(final, dimensions) for final in finals]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (a classifier with runner="pooling"), batched by
        the engine; in input order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        calls = [(lambda prompt, _: self.engine.classify_stream(prompt), p, None) for p in prompts]
        return [self.engine.classification(final) for final in self._run(calls, use_tqdm)]

    def score(
        self,
        text_1: Prompt | Sequence[Prompt],
        text_2: Prompt | Sequence[Prompt],
    ) -> list[ScoringRequestOutput]:
        """Engine.score (runner="pooling"): a cross-encoder's score of each pair, or the
        cosine similarity of its embeddings."""
        return self._call(partial(self.engine.score, text_1, text_2))

    def collective_rpc(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run `fn(worker, *args, **kwargs)` on every worker rank; results by rank."""
        return self._call(partial(self.engine.collective_rpc, fn, *args, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer, as vLLM's LLM gives it: encode, decode,
        apply_chat_template."""
        tokenizer = self.engine.tokenizer
        assert tokenizer is not None  # set once the engine is entered, in __init__
        return tokenizer

    def _run(self, calls: Sequence[tuple[Any, Any, SamplingParams | None]], use_tqdm: bool) -> list:
        with tqdm(total=len(calls), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                return self._call(partial(_run_all, calls, bar))
            except BaseExceptionGroup as eg:
                raise simplest(eg, each="prompts") from None

    def _call(self, func: Callable[[], Awaitable[T]]) -> T:
        """Run `func()` in the engine's loop and wait for it; an interrupt cancels it.

        `portal.call()` would leave the task running when the waiting thread is interrupted
        (Ctrl-C in a notebook): the batch would go on to max_tokens. Here a KeyboardInterrupt
        (any exception) cancels the task, which aborts its requests, then propagates.
        """
        finished = threading.Event()

        async def run() -> T:
            try:
                return await func()
            finally:
                finished.set()

        future = self._require_portal().start_task_soon(run)
        try:
            return future.result()
        except BaseException:
            # cancel() is False once the task has ended: then there is nothing to stop.
            # Bounded: a second Ctrl-C, or a loop that does not answer, must not hang us.
            if future.cancel():
                finished.wait(CANCEL_WAIT_S)
            raise

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the workers (they stay warm in the manager) and stop the loop thread."""
        self._closer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require_portal(self) -> BlockingPortal:
        if not self._closer.alive or self._portal is None:
            raise RuntimeError("this LLM is closed")
        return self._portal

    def _stop_portal(self) -> None:
        if self._portal is not None:
            self._portal.call(self._portal.stop)
        self._thread.join()

    @staticmethod
    def _close_parts(engine_cm: Any, portal: BlockingPortal, thread: threading.Thread) -> None:
        try:
            engine_cm.__exit__(None, None, None)
        finally:
            portal.call(portal.stop)
            # close() returns once the loop is done; a finalizer on that thread cannot join it.
            if thread is not threading.current_thread():
                thread.join()


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int, engine: Engine
) -> list[SamplingParams]:
    """None: the model's defaults (its generation_config), as vLLM's LLM uses them."""
    if params is None or isinstance(params, SamplingParams):
        chosen = [params or engine.default_sampling_params()] * count
    else:
        chosen = list(params)
        if len(chosen) != count:
            raise ValueError(f"got {len(chosen)} sampling_params for {count} prompts")
    # Only the final output matters here; skip building the intermediate ones.
    return [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in chosen]


def _calls(
    submit: Callable[..., Any],
    inputs: Sequence[Any],
    params: list[SamplingParams],
    priority: int | Sequence[int] | None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
) -> list[tuple[Any, Any, SamplingParams]]:
    """(submit with the input's priority and adapter, the input, its params), per input."""
    ranks, loras = _priorities(priority, len(inputs)), _loras(lora_request, len(inputs))
    return [
        (partial(submit, priority=rank, lora_request=lora), item, sp)
        for item, sp, rank, lora in zip(inputs, params, ranks, loras, strict=True)
    ]


def _priorities(priority: int | Sequence[int] | None, count: int) -> list[int]:
    if priority is None or isinstance(priority, int):
        return [priority or 0] * count
    ranks = list(priority)
    if len(ranks) != count:
        raise ValueError(f"got {len(ranks)} priorities for {count} prompts")
    return ranks


def _loras(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter (or none) for every prompt, or one each."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"lora_request holds {len(loras)} entries for {count} prompts")
    return loras


async def _run_all(calls: Sequence[tuple[Any, Any, SamplingParams | None]], bar: tqdm) -> list:
    # Every request starts before any is awaited: a bad prompt raises one ValueError, which
    # says which prompt it was, and the requests started before it are aborted.
    streams: list[RequestStream] = []
    try:
        for method, prompt, params in calls:
            streams.append(method(prompt, params))
    except BaseException as exc:
        for stream in streams:
            stream.close()
        if isinstance(exc, ValueError) and len(calls) > 1:  # len(streams): the bad one's index
            raise ValueError(f"prompt {len(streams)}: {exc}") from exc
        raise
    results: list[RequestOutput | None] = [None] * len(streams)

    async def one(index: int, stream: RequestStream) -> None:
        async with stream:
            async for output in stream:
                results[index] = output
        bar.update(1)

    async with anyio.create_task_group() as tg:
        for index, stream in enumerate(streams):
            tg.start_soon(one, index, stream)
    return results
