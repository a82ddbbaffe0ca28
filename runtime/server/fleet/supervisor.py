"""Keeps a server's Engine alive: restarts it after a worker's death, drains it on shutdown.

The HTTP app reads the current engine from an EngineSlot on every request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus

from loomllm.engine.engine import Engine
from loomllm.errors import LoomError
from loomllm.server.openai.schemas import ApiError

logger = logging.getLogger(__name__)


class EngineSlot:
    """The engine a server uses now; empty while the engine (re)starts or after shutdown.

    The app reads it on every request, so a restart keeps the listening socket open while
    requests get 503. A failed slot stops the server with a non-zero exit code, so that a
    process supervisor (systemd, Kubernetes) restarts the process.
    """

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self.draining = False
        self.failure: str | None = None  # why the engine is gone for good
        self.failed = anyio.Event()
        self.restarts = 0

    def require(self) -> Engine:
        """The running engine, or ApiError(503) saying why there is none."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "service_unavailable")
        if self.engine is None:
            why = self.failure or "the engine is restarting after a failure; retry shortly"
            raise ApiError(503, why, None, "service_unavailable")
        return self.engine

    def fail(self, why: str) -> None:
        self.engine = None
        self.failure = why
        self.failed.set()


async def supervise(
    open_engine: Callable[[], Engine],
    slot: EngineSlot,
    *,
    restart_on_failure: bool = True,
    max_restarts: int = 5,
    restart_window_s: float = 600.0,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run engines from `open_engine()` into `slot` until cancelled.

    Reports started once the first engine runs (its start errors are raised to the caller).
    After a worker's death the engine is replaced, unless restarts are off, more than
    `max_restarts` deaths fell within `restart_window_s`, or the new engine fails to
    start: then `slot.fail()` and return. Cancellation closes the engine.
    """
    deaths: list[float] = []
    started = False
    while True:
        try:
            async with open_engine() as engine:
                slot.engine = engine
                if not started:
                    started = True
                    task_status.started()
                else:
                    logger.warning("engine restarted (%d restarts so far)", slot.restarts)
                await anyio.sleep_forever()
        except Exception as exc:
            # Once running, any failure (a worker's death, or a bug in the step loop) counts
            # as the engine's death; failing to start is fatal, at first or on a restart.
            ran = slot.engine is not None
            slot.engine = None
            if not started:
                raise
            if not ran:
                slot.fail(f"the engine could not be restarted: {exc}")
                logger.error("%s", slot.failure)
                return
            now = time.monotonic()
            deaths = [t for t in deaths if now - t < restart_window_s] + [now]
            logger.error("the engine died: %s", exc, exc_info=not isinstance(exc, LoomError))
            if not restart_on_failure:
                slot.fail(f"the engine died and restarts are off: {exc}")
                return
            if len(deaths) > max_restarts:
                slot.fail(
                    f"the engine died {len(deaths)} times within {restart_window_s:.0f} s;"
                    f" giving up. Last: {exc}"
                )
                return
            slot.restarts += 1
        finally:
            slot.engine = None


async def drain(slot: EngineSlot, grace_s: float) -> None:
    """Refuse new requests, give running ones `grace_s` to finish, then abort the rest.

    Aborted streams end with finish_reason "abort", so clients see a proper ending.
    """
    slot.draining = True
    engine = slot.engine
    if engine is None:
        return
    with anyio.move_on_after(grace_s) as scope:
        await engine.wait_until_idle()
    if scope.cancelled_caught:
        stats = engine.stats()
        logger.warning(
            "grace period over: aborting %d running and %d waiting requests",
            stats.num_running,
            stats.num_waiting,
        )
        engine.abort_all()
