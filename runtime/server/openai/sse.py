"""Server-sent events: the `data: {...}` framing and an ASGI response that aborts on disconnect."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

Send = Callable[[bytes], Awaitable[None]]
DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse:
    """An ASGI response whose body `produce(send)` writes; cancelled when the client leaves.

    It races the producer against the client's `http.disconnect`: a disconnect cancels the
    producer, whose `async with` on the RequestStreams aborts the requests.
    """

    def __init__(
        self,
        produce: Callable[[Send], Awaitable[None]],
        content_type: bytes = b"text/event-stream; charset=utf-8",
    ) -> None:
        self.produce = produce
        self.content_type = content_type  # Ollama's streams are NDJSON on the same footing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", self.content_type), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def send_body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                await self.produce(send_body)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client went away while we wrote; the producer's cleanup ran
            tg.cancel_scope.cancel()
