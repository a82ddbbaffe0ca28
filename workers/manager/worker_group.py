"""One group of worker processes (the ranks of one engine), as the manager sees it.

Each rank is forked by the zygote (or started fresh) in its own session, held by a lifeline.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL

import anyio
from anyio.abc import Process, UNIXSocketStream

from loomllm.protocols.connection import MessageStream, RemoteError
from loomllm.protocols.errors import ProtocolError
from loomllm.protocols.messages import (
    Ack,
    Lease,
    ModelInfo,
    WorkerFailed,
    WorkerInfo,
    WorkerReady,
    WorkersAcquired,
    WorkerSpec,
)
from loomllm.workers.manager.ray_handles import RankHandle, RayPlacement
from loomllm.workers.manager.zygote_client import (
    ForkedProcess,
    ZygoteClient,
    needs_full_zygote,
)

logger = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4000
STOP_GRACE_S = 5.0
# A rank answers a lease from its event loop: only a call that blocks it for this long
# (a stuck collective_rpc, say) delays the answer past it.
LEASE_TIMEOUT_S = 10.0


class GroupStartError(Exception):
    """A rank could not start; the message says why (its own words or its stderr)."""


class LeaseError(Exception):
    """A rank did not take its lease (gone, stuck or broken): the group cannot be lent."""


@dataclass(eq=False)
class WorkerProcess:
    """One rank as the manager holds it: a local process (zygote-forked or not), or a Ray
    actor (ray_group.py: no log file or socket path of ours, a tcp:// address)."""

    rank: int
    process: Process | ForkedProcess | RankHandle
    control: MessageStream
    log_file: Path | None
    socket_path: Path | None
    address: str = ""  # where engines attach: from its READY
    started_at: float = field(default_factory=time.monotonic)
    leases_unanswered: int = 0  # Leases sent whose Ack is still to be read

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_tail(self) -> str:
        if self.log_file is None:
            return self.process.error_text if isinstance(self.process, RankHandle) else ""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        if isinstance(self.process, RankHandle):
            return 0  # its pid may live on another node
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return 0


@dataclass(eq=False)
class WorkerGroup:
    """The ranks of one engine and their state, from launch to stop."""

    group_id: str
    spec: WorkerSpec
    keep_alive: float
    state: str = "loading"  # loading -> busy <-> idle -> stopping
    ranks: list[WorkerProcess] = field(default_factory=list)
    model_info: ModelInfo | None = None
    owner: object | None = None  # the manager's client connection that holds it
    idle_since: float | None = None
    expiry: anyio.CancelScope | None = None
    placement: RayPlacement | None = None  # the Ray ranks' bundles (ray_group.py)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks]

    def acquired(self, lease_token: bytes, *, reused: bool) -> WorkersAcquired:
        """The reply that hands this (ready, leased) group to an engine."""
        assert self.model_info is not None
        return WorkersAcquired(
            self.group_id,
            [r.address for r in self.ranks],
            self.pids,
            self.model_info,
            reused=reused,
            lease_token=lease_token,
        )

    def infos(self, now: float) -> list[WorkerInfo]:
        """One row per rank for `engine-manager ps`."""
        expires = None
        if self.state == "idle" and self.keep_alive > 0 and self.idle_since is not None:
            expires = max(0.0, self.idle_since + self.keep_alive - now)
        dtype = self.model_info.dtype if self.model_info is not None else self.spec.options.dtype
        return [
            WorkerInfo(
                self.group_id,
                w.rank,
                w.pid,
                self.spec.model,
                self.state,
                w.rss_bytes(),
                now - w.started_at,
                float(self.keep_alive),
                expires,
                self.spec.world_size,
                dtype,
            )
            for w in self.ranks
        ]


def spec_problem(spec: WorkerSpec) -> str | None:
    """Why `spec` cannot become a worker command line, or None."""
    if spec.world_size < 1:
        return f"world_size must be >= 1, got {spec.world_size}"
    if not spec.model or "\x00" in spec.model:
        return "model must be a non-empty string without NUL characters"
    return None


async def launch_rank(
    group: WorkerGroup, rank: int, workdir: Path, *, dist_init_file: Path, zygote: ZygoteClient
) -> WorkerProcess:
    """Start one rank (forked by the zygote, else a fresh interpreter); return once its
    process exists, not yet READY.

    One end of a socketpair is its lifeline: READY comes back over it, leases go out over it,
    and its EOF tells the worker that the manager is gone. (Ray ranks, launched by
    ray_group.py, are held the same way over TCP.)"""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log_file = workdir / f"{group.group_id}-rank{rank}.log"
    socket_path = workdir / f"{group.group_id}-rank{rank}.sock"
    args = [
        "--model",
        group.spec.model,
        "--options",
        group.spec.options.to_json(),
        "--rank",
        str(rank),
        "--world-size",
        str(group.spec.world_size),
        "--dist-init-file",
        str(dist_init_file),
        "--socket",
        str(socket_path),
    ]
    try:
        with open(log_file, "wb") as log:  # noqa: ASYNC230 (a local file, opened once)
            full = needs_full_zygote(group.spec)
            process: Process | ForkedProcess | None = await zygote.spawn(
                args, theirs.fileno(), log.fileno(), full=full
            )
            if process is None:
                lifeline = ["--control-fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
                process = await anyio.open_process(
                    [sys.executable, "-P", "-m", "loomllm.workers.worker.main", *args, *lifeline],
                    stdin=DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # own session and process group per worker
                )
    finally:
        theirs.close()
    control = MessageStream(await UNIXSocketStream.from_socket(ours))
    return WorkerProcess(rank, process, control, log_file, socket_path)


async def launch_group(group: WorkerGroup, workdir: Path, zygote: ZygoteClient) -> None:
    """Start every rank, wait for all READYs (they load and rendezvous together)."""
    dist_file = workdir / f"{group.group_id}.dist"
    dist_file.unlink(missing_ok=True)
    for rank in range(group.spec.world_size):
        group.ranks.append(
            await launch_rank(group, rank, workdir, dist_init_file=dist_file, zygote=zygote)
        )
    try:
        await wait_group_ready(group)
    finally:
        dist_file.unlink(missing_ok=True)


async def wait_group_ready(group: WorkerGroup) -> None:
    """Wait for every rank's READY (they load and rendezvous together); note each rank's
    data address and the model's info. GroupStartError from the first rank that fails."""
    readies: list[WorkerReady | None] = [None] * len(group.ranks)

    async def store_ready(worker: WorkerProcess) -> None:
        readies[worker.rank] = await wait_ready(worker)

    try:
        async with anyio.create_task_group() as tg:
            for worker in group.ranks:
                tg.start_soon(store_ready, worker)
    except BaseExceptionGroup as eg:
        start_errors = eg.subgroup(GroupStartError)
        if start_errors is None:
            raise
        raise start_errors.exceptions[0] from None
    for worker, ready in zip(group.ranks, readies, strict=True):
        assert ready is not None
        worker.address = ready.socket
    assert readies[0] is not None
    group.model_info = readies[0].model_info


async def wait_ready(worker: WorkerProcess) -> WorkerReady:
    """READY from the rank, or GroupStartError with its reason or its stderr tail."""
    try:
        msg = await worker.control.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        code = await worker.process.wait()
        raise GroupStartError(
            f"worker rank {worker.rank} exited with {describe_exit(code)} while starting:\n"
            f"{worker.stderr_tail()}"
        ) from None
    if isinstance(msg, WorkerFailed):
        raise GroupStartError(msg.message)
    if not isinstance(msg, WorkerReady):
        raise GroupStartError(f"worker rank {worker.rank} sent {type(msg).__name__}, not READY")
    return msg


async def lease_group(group: WorkerGroup, token: bytes, *, wait: bool = True) -> None:
    """Lend every rank to the engine holding `token` (empty: to nobody).

    With `wait`, return once every rank has taken it (and every lease sent before it), so
    that the engine's Attach finds it there; else only send it. LeaseError when a rank is
    gone or takes longer than LEASE_TIMEOUT_S.
    Cancellation: the lifelines may be left mid-frame; stop the group after it.
    """
    try:
        with anyio.fail_after(LEASE_TIMEOUT_S):
            for worker in group.ranks:
                await worker.control.send(Lease(token))
                worker.leases_unanswered += 1
            if not wait:
                return
            for worker in group.ranks:
                while worker.leases_unanswered:
                    await worker.control.receive_type(Ack)
                    worker.leases_unanswered -= 1
    except (
        TimeoutError,
        anyio.EndOfStream,
        anyio.BrokenResourceError,
        anyio.ClosedResourceError,
        OSError,
        ProtocolError,
        RemoteError,
    ) as exc:
        raise LeaseError(f"group {group.group_id} did not take its lease: {exc!r}") from exc


async def stop_rank(worker: WorkerProcess) -> None:
    """Close its lifeline (it exits by itself), then SIGKILL its group after a grace period.

    Cancellation: shielded; the process is gone when this returns.
    """
    with anyio.CancelScope(shield=True):
        # Its byte stream, which MessageStream.aclose closes: the resource anyio's type takes.
        await anyio.aclose_forcefully(worker.control.stream)
        with anyio.move_on_after(STOP_GRACE_S):
            await worker.process.wait()
        if worker.process.returncode is None:
            logger.warning("worker pid %d ignored EOF; killing it", worker.pid)
            if isinstance(worker.process, RankHandle):
                await worker.process.kill()
            else:
                kill_process_group(worker.pid)
            with anyio.move_on_after(STOP_GRACE_S):  # a Ray rank's node may be unreachable
                await worker.process.wait()
        await worker.process.aclose()
        if worker.socket_path is not None:
            worker.socket_path.unlink(missing_ok=True)


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group that `pid` leads, if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def describe_exit(returncode: int | None) -> str:
    """A process's exit status in words: its exit code or the signal that ended it."""
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"
