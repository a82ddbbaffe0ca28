"""engine-manager: the per-user daemon that launches, watches, lends and reuses workers.

One single-threaded anyio program: a task per client and per rank, timers for idle groups.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
from pathlib import Path

import anyio
from anyio.abc import SocketStream, TaskGroup

from loomllm.protocols.connection import MessageStream, server_handshake
from loomllm.protocols.errors import ProtocolError, VersionMismatchError
from loomllm.protocols.messages import (
    Ack,
    AcquireWorkers,
    ErrorReply,
    ListCachedModels,
    ListWorkers,
    ManagerStatus,
    PullModel,
    ReleaseWorkers,
    ShutdownManager,
    StatusRequest,
    Unloaded,
    UnloadModel,
    WorkerDied,
    WorkerInfo,
    WorkerList,
)
from loomllm.protocols.peer_auth import refusal
from loomllm.protocols.rundir import (
    ensure_private_dir,
    ensure_socket_dir,
    unlink_if_ours,
    workers_dir,
)
from loomllm.workers.manager.pulls import Pulls
from loomllm.workers.manager.ray_group import RayDriver, launch_ray_group
from loomllm.workers.manager.worker_group import (
    GroupStartError,
    LeaseError,
    WorkerGroup,
    WorkerProcess,
    launch_group,
    lease_group,
    spec_problem,
    stop_rank,
)
from loomllm.workers.manager.zygote_client import ZygoteClient

logger = logging.getLogger(__name__)
LEASE_TOKEN_BYTES = 32


class ManagerServer:
    """The daemon's state; `serve()` runs it until stopped or idle (`engine-manager serve`)."""

    def __init__(
        self,
        socket_path: Path,
        *,
        max_workers: int = 8,
        max_keep_alive: float = -1,
        idle_timeout: float = 600,
        exit_with_client: bool = False,
        allowed_uid: int | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.workdir = workers_dir(socket_path)
        self.max_workers = max_workers
        self.max_keep_alive = max_keep_alive
        self.idle_timeout = idle_timeout
        self.exit_with_client = exit_with_client  # private managers die with their engine
        self.allowed_uid = allowed_uid
        self.groups: dict[str, WorkerGroup] = {}
        self.clients: set[MessageStream] = set()
        # A private manager's engine: the first client to say it is one. Only its
        # disconnect ends a private manager; a debugging `ps` or `status` must not.
        self.owner: MessageStream | None = None
        self.started_at = time.monotonic()
        self._group_ids = itertools.count(1)
        self._tg: TaskGroup | None = None
        self._idle_scope: anyio.CancelScope | None = None
        self.zygote = ZygoteClient(self.workdir)
        self.ray = RayDriver()  # connects when a group asks for distributed_executor_backend=ray
        self.pulls = Pulls()

    async def serve(self, *, ready: anyio.Event | None = None) -> None:
        """Listen until `shutdown()` or the idle timeout, setting `ready` once listening.

        Cancellation: as a shutdown, every group is stopped (shielded), then the zygote."""
        ensure_socket_dir(self.socket_path.parent)
        ensure_private_dir(self.workdir)
        listener = await anyio.create_unix_listener(self.socket_path, mode=0o600)
        bound_inode = os.stat(self.socket_path).st_ino  # noqa: ASYNC240
        logger.info("engine-manager pid %d listening on %s", os.getpid(), self.socket_path)
        # The zygote outlives the listener's task group: on the way out the workers are
        # stopped first (EOF on their lifelines), and only then the zygote they came from.
        async with anyio.create_task_group() as zygote_tg:
            zygote_tg.start_soon(self.zygote.run)
            self.zygote.want()  # its imports take seconds: start them before the first engine
            try:
                async with listener, anyio.create_task_group() as tg:
                    self._tg = tg
                    tg.start_soon(listener.serve, self._handle_client)
                    self._arm_idle_timer()
                    if ready is not None:
                        ready.set()
            finally:
                self._tg = None  # closed: nothing may be started in it any more
                try:
                    with anyio.CancelScope(shield=True):
                        for group in list(self.groups.values()):
                            await self._stop_group(group, "manager shutting down")
                finally:
                    unlink_if_ours(self.socket_path, bound_inode)
                    zygote_tg.cancel_scope.cancel()
                    logger.info("engine-manager stopped")

    def shutdown(self) -> None:
        """Make `serve()` stop its groups and return; a no-op once it is shutting down."""
        if self._tg is not None:  # None: shutting down already
            self._tg.cancel_scope.cancel()

    # -- clients ----------------------------------------------------------------------

    async def _handle_client(self, stream: SocketStream) -> None:
        ms = MessageStream(stream)
        async with stream:
            why = refusal(stream, self.allowed_uid)
            if why is not None:
                logger.warning("refused connection: %s", why)
                await ms.send_if_open(ErrorReply("permission_denied", why))
                return
            self.clients.add(ms)
            self._disarm_idle_timer()
            role = None  # until the handshake says
            try:
                role = (await server_handshake(ms, "manager")).role
                if self.exit_with_client and self.owner is None and role == "engine":
                    self.owner = ms
                await self._serve_requests(ms)
            except VersionMismatchError as exc:
                logger.warning("refused client: %s", exc)  # the handshake said why
            except ProtocolError as exc:
                logger.warning("dropping client after protocol error: %s", exc)
                await ms.send_if_open(ErrorReply("protocol_error", str(exc)))
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                pass
            except Exception as exc:
                # A bug or an input we did not foresee costs this client, never the daemon.
                logger.exception("internal error serving a client")
                await ms.send_if_open(ErrorReply("internal_error", f"{type(exc).__name__}: {exc}"))
            finally:
                self.clients.discard(ms)
                with anyio.CancelScope(shield=True):
                    # An engine that went away (closed or killed) returns its workers.
                    for group in [g for g in self.groups.values() if g.owner is ms]:
                        await self._release(group)
                if self.exit_with_client and self._is_owner(ms, role):
                    self.shutdown()
                self._arm_idle_timer()

    def _is_owner(self, ms: MessageStream, role: str | None) -> bool:
        """Whether a private manager's engine is the client leaving. One that never said
        who it was counts while no engine has come: the engine itself, dying as it
        connected, must not leave its private manager running."""
        if role == "cli":
            return False
        return ms is self.owner or self.owner is None

    async def _serve_requests(self, ms: MessageStream) -> None:
        while True:
            request = await ms.receive()
            match request:
                case AcquireWorkers():
                    reply = await self._acquire(ms, request)
                case ReleaseWorkers(group_id=group_id, keep_alive=keep_alive):
                    group = self.groups.get(group_id)
                    if group is not None and group.owner is ms:
                        if keep_alive is not None:
                            group.keep_alive = self._effective_keep_alive(keep_alive)
                        await self._release(group)
                    reply = Ack()
                case StatusRequest():
                    reply = self._status()
                case ListWorkers():
                    reply = WorkerList(self._worker_infos())
                case UnloadModel(model=model):
                    reply = Unloaded(await self._unload(model))
                case PullModel():
                    assert self._tg is not None
                    reply = await self.pulls.serve(ms, request, self._tg)
                case ListCachedModels():
                    reply = await self.pulls.cached_models()
                case ShutdownManager():
                    await ms.send(Ack())
                    self.shutdown()
                    return
                case _:
                    reply = ErrorReply("bad_request", f"{type(request).__name__} is not a request")
            await ms.send(reply)

    # -- worker groups ----------------------------------------------------------------

    def _effective_keep_alive(self, requested: float) -> float:
        if self.max_keep_alive < 0:
            return requested
        if requested < 0:
            return self.max_keep_alive
        return min(requested, self.max_keep_alive)

    async def _acquire(self, ms: MessageStream, req: AcquireWorkers) -> object:
        spec = req.spec
        problem = spec_problem(spec)
        if problem:
            return ErrorReply("bad_request", problem)
        keep_alive = self._effective_keep_alive(req.keep_alive)
        for group in list(self.groups.values()):
            if group.state == "idle" and group.spec == spec:
                self._reserve(group, keep_alive)
                token = await self._lend(group, ms)
                if token is None:
                    continue  # it is being stopped: look further, or launch anew
                logger.info("engine %s reuses warm group %s", req.engine_id, group.group_id)
                return group.acquired(token, reused=True)
        if not await self._make_room(spec.world_size):
            return ErrorReply(
                "capacity",
                f"max-workers is {self.max_workers} and {self._num_workers()} workers are "
                f"busy or loading; a group of {spec.world_size} does not fit",
            )
        group = WorkerGroup(f"g{next(self._group_ids)}", spec, keep_alive)
        self.groups[group.group_id] = group
        try:
            await self._launch(group)
        except GroupStartError as exc:
            await self._stop_group(group, "failed to start")
            return ErrorReply("worker_start_failed", str(exc))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_group(group, "start interrupted")
            raise
        self._reserve(group, keep_alive)
        token = await self._lend(group, ms)
        if token is None:
            return ErrorReply(
                "worker_start_failed",
                f"the new workers of {spec.model!r} "
                "did not take their lease; see the manager's log",
            )
        return group.acquired(token, reused=False)

    async def _lend(self, group: WorkerGroup, owner: MessageStream) -> bytes | None:
        """Lend `group` (just reserved) to `owner`: a fresh lease token that every rank
        admits and the engine shows; None if a rank did not take it or died meanwhile (the
        group is then stopped).

        The owner is set only once the lease is taken: a rank dying while we wait for it
        must not send WorkerDied to an engine that has not been given the group."""
        token = secrets.token_bytes(LEASE_TOKEN_BYTES)
        try:
            await lease_group(group, token)
        except LeaseError as exc:
            logger.warning("%s", exc)
            await self._stop_group(group, "a rank did not take its lease")
            return None
        if group.state != "busy":
            return None
        # No await comes between this and the reply, so a client that goes away is always
        # found by _handle_client's cleanup as this group's owner.
        group.owner = owner
        return token

    async def _launch(self, group: WorkerGroup) -> None:
        assert self._tg is not None
        if group.spec.options.distributed_executor_backend == "ray":
            await launch_ray_group(group, self.ray)
        else:
            await launch_group(group, self.workdir, self.zygote)
        for worker in group.ranks:
            self._tg.start_soon(self._watch, group, worker)

    async def _watch(self, group: WorkerGroup, worker: WorkerProcess) -> None:
        """Wait for the rank to exit; report unexpected deaths to the owning engine."""
        code = await worker.process.wait()
        if group.state == "stopping":
            return
        signum = -code if code < 0 else None
        exit_code = code if code >= 0 else None
        logger.error("worker pid %d of %s died (%s)", worker.pid, group.group_id, code)
        owner = group.owner
        if isinstance(owner, MessageStream):
            died = WorkerDied(
                group.group_id, worker.rank, worker.pid, exit_code, signum, worker.stderr_tail()
            )
            await owner.send_if_open(died)
        await self._stop_group(group, "a rank died")

    def _reserve(self, group: WorkerGroup, keep_alive: float) -> None:
        """Take `group` off the idle list for a lease (_lend sets its owner)."""
        if group.expiry is not None:
            group.expiry.cancel()
            group.expiry = None
        group.state, group.keep_alive, group.idle_since = "busy", keep_alive, None

    async def _release(self, group: WorkerGroup) -> None:
        group.owner = None
        if group.state != "busy":
            return
        if group.keep_alive == 0:
            await self._stop_group(group, "keep_alive is 0")
            return
        try:
            # Its engine is gone, and so is its lease. Not waited for: a rank still busy
            # with that engine's last call answers when it is done (the next _lend reads it).
            await lease_group(group, b"", wait=False)
        except LeaseError as exc:
            logger.warning("%s", exc)
            await self._stop_group(group, "a rank did not take back its lease")
            return
        if group.state != "busy":
            return  # stopped meanwhile (a rank died)
        group.state, group.idle_since = "idle", time.monotonic()
        if group.keep_alive > 0 and self._tg is not None:  # None: shutting down anyway
            group.expiry = anyio.CancelScope()
            self._tg.start_soon(self._expire, group, group.expiry)

    async def _expire(self, group: WorkerGroup, scope: anyio.CancelScope) -> None:
        with scope:
            await anyio.sleep(group.keep_alive)
            await self._stop_group(group, f"idle for keep_alive={group.keep_alive:g}s")

    async def _stop_group(self, group: WorkerGroup, why: str) -> None:
        if group.state == "stopping":
            return
        logger.info("stopping group %s (%s): %s", group.group_id, group.spec.model, why)
        group.state = "stopping"
        if group.expiry is not None:
            group.expiry.cancel()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for worker in group.ranks:
                    tg.start_soon(stop_rank, worker)
            if group.placement is not None:
                await group.placement.remove()
        self.groups.pop(group.group_id, None)
        self._arm_idle_timer()

    async def _make_room(self, needed: int) -> bool:
        """Evict idle groups, least recently used first, until `needed` workers fit."""
        idle = sorted(
            (g for g in self.groups.values() if g.state == "idle"),
            key=lambda g: g.idle_since or 0.0,
        )
        while self._num_workers() + needed > self.max_workers and idle:
            await self._stop_group(idle.pop(0), "evicted to make room (max-workers)")
        return self._num_workers() + needed <= self.max_workers

    async def _unload(self, model: str) -> int:
        count = 0
        for group in list(self.groups.values()):
            if group.spec.model != model:
                continue
            count += len(group.ranks)
            if group.state == "idle":
                await self._stop_group(group, "unloaded")
            else:  # in use: it goes when its engine lets go of it
                group.keep_alive = 0
        return count

    def _num_workers(self) -> int:
        return sum(g.spec.world_size for g in self.groups.values())

    # -- introspection ----------------------------------------------------------------

    def _status(self) -> ManagerStatus:
        return ManagerStatus(
            os.getpid(),
            time.monotonic() - self.started_at,
            str(self.socket_path),
            len(self.clients),
            self._num_workers(),
            self.max_workers,
            float(self.max_keep_alive),
            float(self.idle_timeout),
        )

    def _worker_infos(self) -> list[WorkerInfo]:
        now = time.monotonic()
        return [info for group in self.groups.values() for info in group.infos(now)]

    # -- idle exit --------------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        if self.clients or self.groups or self._idle_scope is not None or self._tg is None:
            return
        if not math.isfinite(self.idle_timeout) or self.idle_timeout < 0:
            return
        self._idle_scope = anyio.CancelScope()
        self._tg.start_soon(self._idle_exit, self._idle_scope)

    def _disarm_idle_timer(self) -> None:
        if self._idle_scope is not None:
            self._idle_scope.cancel()
            self._idle_scope = None

    async def _idle_exit(self, scope: anyio.CancelScope) -> None:
        with scope:
            await anyio.sleep(self.idle_timeout)
            await self.pulls.wait_until_none()  # a download whose askers left still finishes
            logger.info("no clients and no workers for %gs: exiting", self.idle_timeout)
            self.shutdown()
