"""Run an ASGI app on hypercorn in the current event loop (asyncio or trio, via sniffio)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Coroutine
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


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for `serve(app, f"fd://{sock.detach()}", ...)`.

    Binding before the engine starts makes a port in use or an unknown host fail at once,
    as one OSError naming the address, on either loop (hypercorn's own bind fails only
    after the model has loaded, and on asyncio its lifespan task prints a long traceback).
    """
    host = host.removeprefix("[").removesuffix("]")  # "[::1]", as in a URL
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # hypercorn's choice
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As hypercorn sets up a "HOST:PORT" bind: accepted sockets inherit no-Nagle (small
        # streamed chunks go out at once), and a restart may rebind over TIME_WAIT.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror (unknown host) included
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(f"cannot listen on {where}: {exc}") from exc
    return sock


async def serve(
    app: Any,
    bind: str,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    graceful_timeout: float = 5.0,
) -> None:
    """Serve `app` until `shutdown_trigger()` returns, then stop listening and give
    in-flight requests `graceful_timeout` seconds before their connections are dropped.

    Cancellation: the server stops at once; open connections are dropped.
    """
    config = hypercorn_config(bind, graceful_timeout=graceful_timeout)
    hypercorn_serve: Callable[..., Coroutine[Any, Any, None]]
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve
    # In a child task: hypercorn's asyncio TaskGroup (Python 3.11) can leave a cancel
    # request on the task that ran it, which would fail the caller's later cleanup.
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(hypercorn_serve, app, config, shutdown_trigger=shutdown_trigger))
