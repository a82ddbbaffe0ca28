"""RequestStream: the async iterator of one request's outputs, which aborts what it leaves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType

from loomllm.outputs import RequestOutput, RequestOutputCollector


class RequestStream:
    """`async for output in stream`; `aclose()` or leaving the loop aborts the request.

    Not an async generator on purpose: an abandoned one is finalized "some time later",
    while a break, cancellation or deadline drops this stream and aborts the request at
    once, on asyncio and trio alike.
    """

    def __init__(
        self, request_id: str, collector: RequestOutputCollector, abort: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self._collector = collector
        self._abort = abort
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output.

        Cancellation: aborts the request (its blocks are freed before the next step).
        """
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except BaseException:
            self.close()
            raise
        if output.finished:
            self._done = True
        return output

    def close(self) -> None:
        """Abort the request if it is still running (idempotent, safe from __del__)."""
        if not self._done:
            self._done = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def start_all(starts: Iterable[Callable[[], RequestStream]]) -> list[RequestStream]:
    """Every request started, before any is awaited; if one cannot start, those started
    before it are aborted and its error raised (a bad prompt fails the whole call)."""
    streams: list[RequestStream] = []
    try:
        for start in starts:
            streams.append(start())
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams
