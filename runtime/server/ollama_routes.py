"""Ollama's routes over the server's models: /api/generate and /api/chat (NDJSON streams or one
object), /api/embed, /api/tags, /api/ps, /api/show and /api/version, in Ollama's shapes;
errors as Ollama words them, {"error": "..."} with its status."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loomllm.engine.engine import Engine
from loomllm.engine.request_stream import RequestStream, start_all
from loomllm.errors import ModelPullError
from loomllm.outputs import RequestOutput
from loomllm.server.bodies.ollama_bodies import (
    EmbedBody,
    GenerateBody,
    OllamaBody,
    OllamaChatBody,
    PullBody,
)
from loomllm.server.disconnect import unless_disconnected
from loomllm.server.fleet.catalog import ModelEntry
from loomllm.server.fleet.fleet import ModelFleet, ServedModel
from loomllm.server.ollama.keep_alive import keep_alive_seconds
from loomllm.server.ollama.model_card import details, show
from loomllm.server.ollama.options import sampling_params
from loomllm.server.openai.api_error import ApiError, bad
from loomllm.server.openai.body_parsing import parse
from loomllm.server.openai.serving import engine_error, final_outputs
from loomllm.server.openai.sse import EventStreamResponse, Send
from loomllm.server.request_body import read_body
from loomllm.server.state import server_state

NDJSON = b"application/x-ndjson"
FOREVER = "2318-12-31T00:00:00Z"  # Ollama's expires_at for a model kept loaded
Handler = Callable[[Request], Awaitable[Response]]


# A body's `model` picks one of the server's models, loaded on demand, and its `keep_alive`
# says how long it stays loaded after.


async def answer(
    request: Request, served: str, stream: RequestStream, streaming: bool, key: str
) -> Any:
    """One object (FINAL_ONLY) or an NDJSON stream of deltas whose last one is done."""
    if streaming:
        return EventStreamResponse(partial(_lines, served, stream, key), NDJSON)
    out = await unless_disconnected(request, lambda: _final(stream))
    if out is None:  # the client left: its request is aborted, nobody reads this
        return Response(status_code=499)
    return JSONResponse(_done(served, out, key, out.outputs[0].text))


@asynccontextmanager
async def model_for(request: Request, body: OllamaBody) -> AsyncIterator[ServedModel]:
    """The body's model, loaded; its keep_alive applied."""
    fleet = server_state(request).fleet
    keep_alive = keep_alive_seconds(body.keep_alive)
    async with fleet.use(body.model) as served:
        if keep_alive is not None:
            fleet.set_keep_alive(served.name, keep_alive)
        yield served


async def generate(request: Request) -> Response:
    body = parse(GenerateBody, await read_body(request))
    async with model_for(request, body) as served:
        engine = served.engine
        prompt = body.prompt
        stream = body.stream is not False
        params = sampling_params(body, engine.sampling_defaults, stream)
        if not prompt:  # Ollama's way to load a model (or, with keep_alive 0, unload it)
            return _loaded(served.name, body, "response", "")
        system = body.system
        templated = not body.raw and engine.tokenizer is not None
        if templated and engine.tokenizer.chat_templates:  # type: ignore[union-attr]
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            run = _started(
                lambda: engine.chat(messages, params, lora_request=served.lora), "prompt"
            )
        else:
            text = f"{system}\n\n{prompt}" if system else prompt
            run = _started(
                lambda: engine.generate(text, params, lora_request=served.lora), "prompt"
            )
        return await answer(request, served.name, run, stream, "response")


async def chat(request: Request) -> Response:
    body = parse(OllamaChatBody, await read_body(request))
    async with model_for(request, body) as served:
        engine = served.engine
        messages = body.raw_messages()
        if not messages:  # as an empty prompt to /api/generate
            return _loaded(served.name, body, "message", {"role": "assistant", "content": ""})
        stream = body.stream is not False
        params = sampling_params(body, engine.sampling_defaults, stream)
        run = _started(lambda: engine.chat(messages, params, lora_request=served.lora), "messages")
        return await answer(request, served.name, run, stream, "message")


async def embed(request: Request) -> Response:
    body = parse(EmbedBody, await read_body(request))
    async with model_for(request, body) as served:
        engine = served.engine
        inputs = [body.input] if isinstance(body.input, str) else body.input
        dimensions = body.dimensions
        started = time.time()
        keep = engine.max_model_len - 1 if body.truncate is not False else None

        starts = (
            partial(engine.embed_stream, text, dimensions=dimensions, truncate_prompt_tokens=keep)
            for text in inputs
        )
        streams = _started(lambda: start_all(starts), "input")
        by_index = await final_outputs(streams)
        finals = [by_index[i] for i in range(len(streams))]
        vectors = [engine.embedding(final, dimensions).outputs.embedding for final in finals]
    return JSONResponse(
        {
            "model": served.name,
            "embeddings": vectors,
            "total_duration": _ns(time.time() - started),
            "load_duration": 0,
            "prompt_eval_count": sum(len(f.prompt_token_ids) for f in finals),
        }
    )


async def tags(request: Request) -> Response:
    fleet = server_state(request).fleet
    running = {served.name: served.engine for served in fleet.running()}
    listings = [_listing(entry, running.get(entry.name)) for entry in await fleet.available()]
    return JSONResponse({"models": listings})


async def ps(request: Request) -> Response:
    listings = []
    for loaded in server_state(request).fleet.loaded():
        engine = loaded.slot.engine
        if engine is None or loaded.unloading:
            continue
        listing = _listing(loaded.entry, engine)
        expires = loaded.expires_at()
        listing.update(
            # Loaded until evicted or the server stops: Ollama's far-future "forever".
            expires_at=FOREVER if expires is None else _iso(expires),
            size_vram=listing["size"] if engine.model_info.device.startswith("cuda") else 0,
            context_length=engine.max_model_len,
        )
        listings.append(listing)
    return JSONResponse({"models": listings})


async def show_model(request: Request) -> Response:
    body = parse(OllamaBody, await read_body(request))
    async with model_for(request, body) as served:
        return JSONResponse(show(served.engine))


async def version(request: Request) -> Response:
    try:
        return JSONResponse({"version": metadata.version("loomllm")})
    except metadata.PackageNotFoundError:
        return JSONResponse({"version": "unknown"})


async def pull(request: Request) -> Response:
    body = parse(PullBody, await read_body(request))
    fleet = server_state(request).fleet
    name = body.model or body.name
    if name is None:
        raise bad("model is required", "model")
    if body.stream is False:
        await _pulled(fleet, name, lambda report: None)
        return JSONResponse({"status": "success"})
    return EventStreamResponse(partial(_pull_lines, fleet, name), NDJSON)  # type: ignore[return-value]


def _ollama_errors(handler: Handler) -> Handler:
    """Ollama's error shape: {"error": message}, with the status."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status)

    return answer


def _started(start: Callable[[], Any], param: str) -> Any:
    """`start()`, its ValueError a 400 naming `param` (or the field it names)."""
    try:
        return start()
    except ValueError as exc:
        raise bad(str(exc), param) from None
    except Exception as exc:
        raise engine_error(exc) from None


async def _final(stream: RequestStream) -> RequestOutput:
    async with stream:
        try:
            return await anext(stream)
        except Exception as exc:
            raise engine_error(exc) from None


async def _lines(served: str, stream: RequestStream, key: str, send: Send) -> None:
    """The NDJSON stream's lines: a delta each, then the done object. Cancelled when the
    client leaves (EventStreamResponse), which aborts the request."""
    async with stream:
        async for out in stream:
            text = out.outputs[0].text
            if out.finished:
                await send(_line(_done(served, out, key, text)))
            elif text:
                await send(_line(_chunk(served, **_text(key, text))))


async def _pulled(fleet: ModelFleet, name: str, on_progress: Callable[[Any], None]) -> None:
    """A pull through the default model's engine-manager, its refusals as Ollama's errors."""
    try:
        async with fleet.use(None) as served:
            await served.engine.pull(name, on_progress=on_progress)
    except ValueError as exc:
        raise bad(str(exc), "model") from None
    except ModelPullError as exc:
        raise ApiError(404 if "not found" in str(exc) else 500, str(exc), "model") from None


async def _pull_lines(fleet: ModelFleet, name: str, send_line: Send) -> None:
    """Ollama's pull stream: its steps, the bytes so far, then success (or an error line)."""
    send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)

    def report(progress: Any) -> None:
        send.send_nowait(
            {
                "status": f"pulling {name}",
                "digest": "",
                "total": progress.total_bytes,
                "completed": progress.done_bytes,
            }
        )

    async def run() -> None:
        with send:
            try:
                await _pulled(fleet, name, report)
                send.send_nowait({"status": "success"})
            except ApiError as exc:
                send.send_nowait({"error": exc.message})

    await send_line(_line({"status": "pulling manifest"}))
    async with anyio.create_task_group() as tg, receive:
        tg.start_soon(run)
        async for item in receive:
            await send_line(_line(item))


def _text(key: str, text: str) -> dict[str, Any]:
    if key == "message":
        return {"message": {"role": "assistant", "content": text}}
    return {"response": text}


def _loaded(served: str, body: OllamaBody, key: str, empty: Any) -> JSONResponse:
    """The answer to a request that only loads its model (or, with keep_alive 0, unloads it)."""
    reason = "unload" if keep_alive_seconds(body.keep_alive) == 0 else "load"
    return JSONResponse(_chunk(served, done_reason=reason, **{key: empty}))


def _chunk(served: str, done_reason: str | None = None, **rest: Any) -> dict:
    chunk = {"model": served, "created_at": _now(), **rest, "done": done_reason is not None}
    if done_reason is not None:
        chunk["done_reason"] = done_reason
    return chunk


def _done(served: str, out: RequestOutput, key: str, text: str) -> dict:
    """The last object: the text's end, why it ended, and Ollama's counts and durations."""
    completion, m = out.outputs[0], out.metrics
    end = m.finished_time or time.time()
    first = m.first_token_time or end
    return _chunk(
        served,
        done_reason="length" if completion.finish_reason == "length" else "stop",
        **_text(key, text),
        total_duration=_ns(end - m.arrival_time),
        load_duration=0,
        prompt_eval_count=len(out.prompt_token_ids),
        prompt_eval_duration=_ns(first - m.arrival_time),
        eval_count=len(completion.token_ids),
        eval_duration=_ns(end - first),
    )


def _listing(entry: ModelEntry, engine: Engine | None) -> dict[str, Any]:
    """The model as /api/tags lists it; read from its files where they are on this machine
    (all of it once loaded, else a local folder or GGUF file)."""
    info = engine.model_info if engine is not None else None
    path = Path((info.weights_path or info.model_dir) if info is not None else entry.model)
    files = (
        [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.gguf"))
    )
    size = sum(p.stat().st_size for p in files)
    modified = path.stat().st_mtime if path.exists() else time.time()
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": _iso(modified),
        "size": size,
        "digest": "",
        "details": details(engine) if engine is not None else {},
    }


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _now() -> str:
    return _iso(time.time())


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


OLLAMA_ROUTES = [
    Route("/api/generate", _ollama_errors(generate), methods=["POST"]),
    Route("/api/pull", _ollama_errors(pull), methods=["POST"]),
    Route("/api/chat", _ollama_errors(chat), methods=["POST"]),
    Route("/api/embed", _ollama_errors(embed), methods=["POST"]),
    Route("/api/tags", _ollama_errors(tags), methods=["GET"]),
    Route("/api/ps", _ollama_errors(ps), methods=["GET"]),
    Route("/api/show", _ollama_errors(show_model), methods=["POST"]),
    Route("/api/version", _ollama_errors(version), methods=["GET"]),
]
