"""The manager's handles on what it holds in a Ray cluster: one rank's actor, one group's
placement group. Ray's calls block, so each runs in a thread; `ray` is passed in, never
imported here, so the local path never loads it.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import anyio

logger = logging.getLogger(__name__)

# A call to Ray that does not answer by then is given up (the manager must not hang).
RAY_CALL_TIMEOUT_S = 30.0


class RankHandle:
    """A rank's actor, as the manager's process handle: `wait()` ends with its `serve()`
    call (its exit code; 1 if it raised), or with the actor's death (read as SIGKILL);
    `error_text` keeps Ray's word on either."""

    def __init__(self, ray: Any, actor: Any, pid: int, serve_ref: Any) -> None:
        self.ray = ray
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self.error_text = ""
        self._serve_ref = serve_ref
        # Its own threads: a rank's whole life spent in ray.get must not hold one of the
        # default limiter's 40 tokens that every other to_thread call of the manager needs.
        self._threads = anyio.CapacityLimiter(4)

    async def wait(self) -> int:
        """Cancellation: the thread's ray.get is abandoned; a later wait asks again."""
        if self.returncode is None:
            try:
                code = await anyio.to_thread.run_sync(
                    self.ray.get, self._serve_ref, abandon_on_cancel=True, limiter=self._threads
                )
            except self.ray.exceptions.RayActorError as exc:  # the actor's process is gone
                code, self.error_text = -signal.SIGKILL, f"{type(exc).__name__}: {exc}"[-4000:]
            except Exception as exc:  # serve() raised
                code, self.error_text = 1, f"{type(exc).__name__}: {exc}"[-4000:]
            if self.returncode is None:
                self.returncode = code
        return self.returncode

    async def kill(self) -> None:
        """End the actor (and so its process) now; bounded, like every call to Ray here."""
        with anyio.move_on_after(RAY_CALL_TIMEOUT_S):
            try:
                await anyio.to_thread.run_sync(
                    self.ray.kill, self.actor, abandon_on_cancel=True, limiter=self._threads
                )
            except Exception as exc:  # already gone, or the cluster is
                logger.info("ray.kill of rank pid %d: %s", self.pid, exc)

    async def aclose(self) -> None:
        """After the rank has ended: free its actor (an idle actor holds its bundle)."""
        await self.kill()


class RayPlacement:
    """One group's placement group: one bundle per rank, removed when the group stops."""

    def __init__(self, ray: Any, placement_group: Any) -> None:
        self.ray = ray
        self.placement_group = placement_group

    async def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with anyio.move_on_after(RAY_CALL_TIMEOUT_S):
            try:
                await anyio.to_thread.run_sync(
                    remove_placement_group, self.placement_group, abandon_on_cancel=True
                )
            except Exception as exc:  # the cluster may be gone: nothing left to free then
                logger.warning("could not remove placement group: %s", exc)
