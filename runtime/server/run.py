"""Run an ASGI app on hypercorn in the current event loop (asyncio or trio, via sniffio)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import sniffio
from hypercorn.config import Config


def hypercorn_config(bind: str, *, graceful_timeout: float = 5.0) -> Config:
    """`bind` is "HOST:PORT" or "fd://N" (an already bound socket, e.g. port 0 in tests)."""
    config = Config()
    config.bind = [bind]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    return config


async def serve(
    app: Any, bind: str, shutdown_trigger: Callable[[], Awaitable[Any]],
    graceful_timeout: float = 5.0,
) -> None:  # fmt: skip
    """Serve `app` until `shutdown_trigger()` returns, then stop listening and give
    in-flight requests `graceful_timeout` seconds before their connections are dropped.

    Cancellation: the server stops at once; open connections are dropped.
    """
    config = hypercorn_config(bind, graceful_timeout=graceful_timeout)
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve
    # In a child task: hypercorn's asyncio TaskGroup (Python 3.11) can leave a cancel
    # request on the task that ran it, which would fail the caller's later cleanup.
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(hypercorn_serve, app, config, shutdown_trigger=shutdown_trigger))
