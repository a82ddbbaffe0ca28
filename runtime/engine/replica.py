"""Replica: one copy of the model behind an Engine, with its own worker group and step loop.

An Engine runs `data_parallel_size` replicas, each with its own EngineCore and KV blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio
from anyio.abc import TaskGroup

from loomllm.clients.manager import RELEASE_TIMEOUT_S, ManagerClient
from loomllm.clients.workers import WorkerClient
from loomllm.config import EngineConfig
from loomllm.engine.core import EngineCore
from loomllm.engine.core_builder import build_engine_core
from loomllm.errors import EngineDeadError, ManagerError
from loomllm.metrics.stats import EngineStats
from loomllm.protocols.messages import WorkerDied, WorkersAcquired
from loomllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long a broken worker connection waits for the manager's report of why.
DEATH_REPORT_WAIT_S = 0.5


class Replica:
    """One worker group and the EngineCore that drives it; `dead` once a rank is lost.

    A lost rank fails this replica's requests with EngineDeadError; `on_death` lets the
    Engine decide whether the other replicas go on.
    """

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        engine_id: str,
        on_death: Callable[[Replica], bool],
    ) -> None:
        self.index = index
        self.config = config
        self.engine_id = engine_id
        self.acquired: WorkersAcquired | None = None
        self.workers: WorkerClient | None = None
        self.core: EngineCore | None = None
        self.dead: EngineDeadError | None = None
        # Called once, at death: True when the engine goes on without this replica.
        self._on_death = on_death
        self._survived = False
        self._lost = anyio.Event()
        self._lost_reason = ""
        self._death_report: WorkerDied | None = None
        self._death_reported = anyio.Event()
        # Seconds the workers stay warm once released, in place of config.keep_alive.
        self.release_keep_alive: float | None = None

    async def start(
        self,
        stack: AsyncExitStack,
        tg: TaskGroup,
        manager: ManagerClient,
        tokenizer: Tokenizer | None,
    ) -> None:
        """Acquire and attach the workers, start the step loop; `stack` undoes it all.

        `tokenizer`: one an earlier replica loaded (same model), else None to load it.
        """
        cfg = self.config
        spec = cfg.worker_spec(self.index)
        self.acquired = await manager.acquire(spec, cfg.keep_alive, self.engine_id)
        stack.push_async_callback(self._release, manager, self.acquired.group_id)
        workers = await self._attach(self.acquired)
        stack.push_async_callback(workers.aclose)
        workers.start_readers(tg, self._on_rank_lost)
        self.workers = workers
        tg.start_soon(self._watch_for_death)
        self.core = build_engine_core(cfg, self.acquired.model_info, workers, tokenizer)
        core_scope, core_done = anyio.CancelScope(), anyio.Event()

        async def run_core(core: EngineCore) -> None:
            try:
                with core_scope:
                    await core.run()
            except EngineDeadError as exc:
                if not self._die(exc):
                    raise  # this was the engine's last replica: the engine dies with it
            finally:
                core_done.set()

        async def stop_core() -> None:
            # First on the way out: a step still in flight (the one that tells the worker
            # about the last finished requests, say) must end before the worker sockets
            # close, or it would fail as a dead worker and raise from __aexit__.
            core_scope.cancel()
            with anyio.CancelScope(shield=True):
                await core_done.wait()

        tg.start_soon(run_core, self.core)
        stack.push_async_callback(stop_core)

    async def _attach(self, acquired: WorkersAcquired) -> WorkerClient:
        """Connect to the acquired ranks; a rank that died since then is EngineDeadError.

        The manager's report of that death (signal, stderr) says more than the broken
        socket does, so a failed attach waits briefly for it.
        """
        try:
            return await WorkerClient.connect(acquired.sockets, acquired.lease_token)
        except ManagerError as exc:
            with anyio.move_on_after(DEATH_REPORT_WAIT_S):
                await self._death_reported.wait()
            if self._lost.is_set():
                raise EngineDeadError(self._death_reason()) from exc
            raise

    @property
    def is_alive(self) -> bool:
        """Not dead, nor about to be declared so (a rank's connection already broke)."""
        return self.dead is None and not self._lost.is_set()

    @property
    def load(self) -> int:
        """vLLM's data-parallel routing score: 4 x waiting + running (children count)."""
        assert self.core is not None
        return 4 * self.core.scheduler.num_waiting + self.core.scheduler.num_running

    def stats(self) -> EngineStats:
        assert self.core is not None
        return dataclasses.replace(self.core.stats(), is_alive=self.is_alive)

    async def _release(self, manager: ManagerClient, group_id: str) -> None:
        if self._lost.is_set():
            return  # the manager tears a broken group down itself
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(RELEASE_TIMEOUT_S):
                await manager.release(group_id, self.release_keep_alive)
        except (ManagerError, OSError, anyio.BrokenResourceError, TimeoutError) as exc:
            # Closing our connection releases the workers too; this was the polite way.
            logger.warning("could not release workers cleanly: %s", exc)

    # -- death ------------------------------------------------------------------------

    def on_worker_died(self, report: WorkerDied) -> None:
        """The manager's report on one of our ranks."""
        self._death_report = report
        self._death_reported.set()
        self._on_rank_lost(report.rank, "the engine-manager reported its death")

    def _on_rank_lost(self, rank: int, why: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = why
            self._lost.set()

    async def _watch_for_death(self) -> None:
        await self._lost.wait()
        with anyio.move_on_after(DEATH_REPORT_WAIT_S):
            await self._death_reported.wait()
        error = EngineDeadError(self._death_reason())
        if not self._die(error):
            raise error

    def _die(self, error: EngineDeadError) -> bool:
        """Mark the replica dead (once) and fail its calls; True if the engine goes on."""
        if self.dead is None:
            self.dead = error
            assert self.workers is not None
            self.workers.fail(error)
            self._survived = self._on_death(self)
        return self._survived

    def _death_reason(self) -> str:
        report = self._death_report
        if report is None:
            return f"engine lost its worker: {self._lost_reason}"
        how = (
            f"killed by signal {signal.Signals(report.signal).name}"
            if report.signal is not None
            else f"exited with code {report.exit_code}"
        )
        tail = report.stderr_tail.strip()
        return f"worker rank {report.rank} (pid {report.pid}) {how}" + (
            f"; its stderr ended with:\n{tail}" if tail else ""
        )


def least_loaded(live: list[Replica], turn: int) -> Replica:
    """The replica of `live` (not empty) with the lowest load; ties go round-robin from
    `turn`. The counts are exact at once (intake is synchronous), so a burst alternates."""
    start = turn % len(live)
    rotated = live[start:] + live[:start]
    return min(rotated, key=lambda r: r.load)
