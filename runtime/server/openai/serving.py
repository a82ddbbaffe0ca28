"""Completions and chat completions: start engine requests, shape OpenAI bodies and chunks.

Between app.py and the Engine; every RequestStream is held in `async with`, so leaving aborts it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import anyio

from loomllm.engine.engine import Engine
from loomllm.engine.request_stream import RequestStream, start_all
from loomllm.errors import EngineClosedError, EngineDeadError, RequestRefusedError
from loomllm.outputs import CompletionOutput, Logprob, RequestOutput
from loomllm.server.openai import sse
from loomllm.server.openai.chat_answers import ChatDeltas, chat_message
from loomllm.server.openai.chat_template_fields import TEMPLATE_ERRORS
from loomllm.server.openai.schemas import (
    MAX_MESSAGE_CHARS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    as_field,
    bad,
    from_value_error,
)


def start_streams(
    engine: Engine, prompts: list[Any], req: CompletionRequest | ChatRequest, base_id: str
) -> list[RequestStream]:
    """One engine request per prompt; a bad prompt aborts those already started (400)."""
    priority = req.common.priority

    def start(i: int, prompt: Any) -> RequestStream:
        rid = f"{base_id}-{i}"
        if isinstance(req, ChatRequest):
            return engine.chat(
                req.messages,
                req.common.params,
                request_id=rid,
                priority=priority,
                max_tokens_must_fit=True,
                lora_request=req.common.lora,
                **req.template.chat_kwargs(req.tools),
            )
        return engine.generate(
            prompt,
            req.common.params,
            request_id=rid,
            priority=priority,
            max_tokens_must_fit=True,
            lora_request=req.common.lora,
        )

    try:
        return start_all(partial(start, i, p) for i, p in enumerate(prompts))
    except ValueError as exc:
        # A chat's prompt is its rendered messages: a prompt error names them.
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        renames = {
            "prompt_token_ids": param,
            "prompt": param,
            "priority": "priority",
            **TEMPLATE_ERRORS,
        }
        raise from_value_error(exc, param, renames) from None
    except (EngineDeadError, EngineClosedError) as exc:  # it died since the request came in
        raise engine_error(exc) from None


async def final_outputs(
    streams: list[RequestStream], structured_field: str | None = None
) -> dict[int, RequestOutput]:
    """Each stream's last output, by its index, as they come; an engine error as the API's."""
    finals: dict[int, RequestOutput] = {}

    async def keep(i: int, out: RequestOutput) -> None:
        finals[i] = out

    try:
        await drive(streams, keep)
    except Exception as exc:
        raise engine_error(exc, structured_field) from exc
    return finals


async def drive(
    streams: list[RequestStream], handle: Callable[[int, RequestOutput], Awaitable[None]]
) -> None:
    """Call handle(prompt index, output) for all streams' outputs as they come, in this task.

    An engine error is raised here. Cancellation: every request is aborted.
    """
    send, receive = anyio.create_memory_object_stream[tuple[int, Any]](len(streams))

    async def pump(i: int, stream: RequestStream, out: Any) -> None:
        async with out, stream:
            try:
                async for item in stream:
                    await out.send((i, item))
            except Exception as exc:  # delivered to the consumer, not the task group
                await out.send((i, exc))

    error: Exception | None = None
    async with AsyncExitStack() as stack:
        for s in streams:
            stack.push_async_callback(s.aclose)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        async with send:
            for i, s in enumerate(streams):
                tg.start_soon(pump, i, s, send.clone())
        async with receive:
            try:
                async for i, item in receive:
                    if isinstance(item, Exception):
                        raise item
                    await handle(i, item)
            except Exception as exc:  # re-raised below, outside the group, so never wrapped
                error = exc
    if error is not None:
        raise error


class PrimedStream:
    """A RequestStream whose first output was read already: it comes first."""

    def __init__(self, first: RequestOutput, rest: RequestStream) -> None:
        self._first: RequestOutput | None = first
        self._rest = rest

    def __aiter__(self) -> PrimedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    def close(self) -> None:
        self._rest.close()

    async def aclose(self) -> None:
        self._rest.close()

    async def __aenter__(self) -> PrimedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._rest.close()


async def primed(streams: list[RequestStream], structured_field: str) -> list[PrimedStream]:
    """Each stream with its first output read; a failure closes them all (ApiError)."""
    try:
        return [PrimedStream(await s.__anext__(), s) for s in streams]
    except BaseException as exc:
        for s in streams:
            s.close()
        if isinstance(exc, Exception):
            raise engine_error(exc, structured_field) from exc
        raise


def engine_error(exc: Exception, structured_field: str | None = None) -> ApiError:
    """A dead or closed engine is 503 (retry later: it restarts); a request the workers
    refused (a grammar that does not compile) 400 naming `structured_field`; any other
    failure 500."""
    if isinstance(exc, RequestRefusedError):
        message = str(exc) if structured_field is None else as_field(str(exc), structured_field)
        return bad(message[:MAX_MESSAGE_CHARS], structured_field)
    if isinstance(exc, EngineDeadError | EngineClosedError):
        return ApiError(
            503, f"the engine stopped during this request: {exc}", None, "service_unavailable"
        )
    return ApiError(500, f"the engine failed this request: {exc}", None, "internal_error")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects as one, `first`'s entries first."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in first}


class Formatter:
    """Turns CompletionOutputs into OpenAI choice objects (text or chat, logprobs)."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        chat: bool,
        want_logprobs: bool,
        as_token_ids: bool = False,
    ) -> None:
        assert engine.tokenizer is not None
        self.tokenizer = engine.tokenizer
        self.model, self.chat, self.want_logprobs = model, chat, want_logprobs
        self.as_token_ids = as_token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # choice index -> text offset so far (completions)

    def token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_token_ids:  # vLLM's return_tokens_as_token_ids: tokens no text spells
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, index: int, c: CompletionOutput) -> dict[str, Any] | None:
        if not self.want_logprobs or c.logprobs is None:
            return None
        entries = list(zip(c.token_ids, c.logprobs, strict=False))
        if self.chat:
            content = []
            for tid, row in entries:
                top = sorted((lp.rank, t, lp) for t, lp in row.items() if lp.rank is not None)
                tok = self.token_text(tid, row.get(tid))
                content.append(
                    {
                        "token": tok,
                        "logprob": row[tid].logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": (s := self.token_text(t, lp)),
                                "logprob": lp.logprob,
                                "bytes": list(s.encode()),
                            }
                            for _, t, lp in top
                        ],
                    }
                )
            return {"content": content}
        return self._text_logprobs(index, entries)

    def prompt_logprobs(
        self, index: int, token_ids: list[int], rows: list[dict[int, Logprob] | None] | None
    ) -> dict[str, Any] | None:
        """The echoed prompt's part of a completion choice's logprobs: it goes first."""
        if not self.want_logprobs or rows is None:
            return None
        return self._text_logprobs(index, list(zip(token_ids, rows, strict=True)))

    def _text_logprobs(
        self, index: int, entries: Sequence[tuple[int, dict[int, Logprob] | None]]
    ) -> dict[str, Any]:
        """Completions' logprobs object; a None row (the first prompt token) has nulls."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = self.offsets.get(index, 0)
        for tid, row in entries:
            tok = self.token_text(tid, None if row is None else row.get(tid))
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
            if row is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(row[tid].logprob)
            ranked = sorted((lp.rank, t, lp) for t, lp in row.items() if lp.rank is not None)
            tops.append({self.token_text(t, lp): lp.logprob for _, t, lp in ranked})
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def envelope(self, choices: list[Any], chunk: bool, usage_: Any = None) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if not chunk or usage_ is not None:
            body["usage"] = usage_
        return body


def formatter_and_prompts(
    engine: Engine, req: CompletionRequest | ChatRequest, model: str
) -> tuple[Formatter, list[Any]]:
    """The answer's Formatter, and the prompts to start (chat: one, from its messages)."""
    if isinstance(req, ChatRequest):
        return Formatter(engine, model, True, req.want_logprobs, req.common.tokens_as_ids), [None]
    wants_logprobs = req.common.params.logprobs is not None
    return Formatter(engine, model, False, wants_logprobs, req.common.tokens_as_ids), req.prompts


async def complete(engine: Engine, req: CompletionRequest | ChatRequest, model: str) -> Any:
    """The whole answer as one body (stream: false)."""
    chat = isinstance(req, ChatRequest)
    fmt, prompts = formatter_and_prompts(engine, req, model)
    streams = start_streams(engine, prompts, req, fmt.id)
    finals = await final_outputs(streams, req.common.structured_field)
    n = req.common.params.n
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i in range(len(prompts)):
        out = finals[i]
        prompt_tokens += len(out.prompt_token_ids)
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            index = i * n + c.index
            choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
            if isinstance(req, ChatRequest):
                choice["message"], choice["finish_reason"] = chat_message(
                    req, c.text, c.finish_reason, out.prompt
                )
            else:
                echo = req.echo and (
                    out.prompt
                    if out.prompt is not None
                    else fmt.tokenizer.decode(out.prompt_token_ids)
                )
                choice["text"] = (echo or "") + c.text
            echoed = None
            if not chat and req.echo:  # first, so that text_offset runs on into the completion
                echoed = fmt.prompt_logprobs(index, out.prompt_token_ids, out.prompt_logprobs)
            choice["logprobs"] = joined(echoed, fmt.logprobs(index, c))
            choices.append(choice)
    return fmt.envelope(choices, chunk=False, usage_=usage(prompt_tokens, completion_tokens))


async def stream(engine: Engine, req: CompletionRequest | ChatRequest, model: str) -> Any:
    """Start the requests now (bad input: ApiError before any byte), return the SSE producer.

    A request with a grammar (structured outputs, a demanded tool call) is read up to its
    first output first: one the workers refuse (a grammar that does not compile) is a 400,
    as vLLM answers it, not an error event inside a 200 stream."""
    fmt, prompts = formatter_and_prompts(engine, req, model)
    streams: list[Any] = start_streams(engine, prompts, req, fmt.id)
    if req.common.structured_field is not None:
        streams = await primed(streams, req.common.structured_field)
    n = req.common.params.n

    prompt_tokens: dict[int, int] = {}  # by prompt
    choice_tokens: dict[int, int] = {}  # by choice, so far

    def chunk(
        index: int, piece: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> bytes:
        choice = {"index": index, **piece, "logprobs": logprobs, "finish_reason": finish}
        used = None
        if req.common.continuous_usage:
            used = usage(prompt_tokens[index // n], choice_tokens.get(index, 0))
        return sse.event(fmt.envelope([choice], chunk=True, usage_=used))

    async def produce(send: sse.Send) -> None:
        completion_tokens = 0
        started: set[int] = set()
        # Prompt logprobs by request: under DELTA only its first output carries them, and all
        # of its n choices echo them.
        prompt_lps: dict[int, Any] = {}

        deltas = ChatDeltas(req) if isinstance(req, ChatRequest) else None

        async def handle(i: int, out: RequestOutput) -> None:
            nonlocal completion_tokens
            prompt_tokens[i] = len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * n + c.index
                if index not in started:
                    started.add(index)
                    if deltas is not None:
                        await send(chunk(index, {"delta": deltas.first(index, out.prompt)}))
                    elif req.echo:
                        text = (
                            out.prompt
                            if out.prompt is not None
                            else fmt.tokenizer.decode(out.prompt_token_ids)
                        )
                        echoed = fmt.prompt_logprobs(index, out.prompt_token_ids, prompt_lps.get(i))
                        await send(chunk(index, {"text": text}, echoed))
                completion_tokens += len(c.token_ids)
                choice_tokens[index] = choice_tokens.get(index, 0) + len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                finish, logprobs = c.finish_reason, fmt.logprobs(index, c)
                if deltas is not None:
                    delta, finish, logprobs = deltas.next(index, c.text, finish, logprobs)
                    if delta is None:
                        continue
                    piece: dict[str, Any] = {"delta": delta}
                else:
                    piece = {"text": c.text}
                await send(chunk(index, piece, logprobs, finish))

        try:
            await drive(streams, handle)
        except Exception as exc:
            await send(sse.event(engine_error(exc, req.common.structured_field).body()))
        else:
            if req.common.include_usage:
                used = usage(sum(prompt_tokens.values()), completion_tokens)
                await send(sse.event(fmt.envelope([], chunk=True, usage_=used)))
        await send(sse.DONE)

    return produce
