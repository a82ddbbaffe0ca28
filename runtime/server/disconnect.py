"""unless_disconnected: a route's work, cancelled when its client goes away."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request


async def unless_disconnected(request: Request, run: Callable[[], Awaitable[Any]]) -> Any:
    """`await run()`, cancelled if the client disconnects first (then None is returned).

    Cancellation of run() leaves its RequestStreams, which aborts their requests.
    """
    result: Any = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await run()
        except Exception as exc:  # re-raised below, outside the group, so never wrapped
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result
