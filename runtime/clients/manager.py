"""Find, start and talk to the engine-manager: the engine's control connection.

A shared daemon serves every engine of the user; a PrivateManager is our child and exits with us.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import anyio
from anyio.abc import Process, TaskStatus

from loomllm.errors import ManagerError, ModelPullError, WorkerStartError
from loomllm.protocols.connection import MessageStream, RemoteError, open_unix_connection
from loomllm.protocols.errors import ProtocolError
from loomllm.protocols.messages import (
    Ack,
    AcquireWorkers,
    CachedModel,
    CachedModelList,
    ErrorReply,
    ListCachedModels,
    ListWorkers,
    Pulled,
    PullModel,
    PullProgress,
    ReleaseWorkers,
    WorkerDied,
    WorkerInfo,
    WorkerList,
    WorkersAcquired,
    WorkerSpec,
)
from loomllm.protocols.rundir import log_path

logger = logging.getLogger(__name__)
R = TypeVar("R")

MANAGER_START_TIMEOUT_S = 30.0
# Loading a model from GGUF the first time takes tens of seconds on a small CPU.
ACQUIRE_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 30.0  # a request the manager answers from memory
# Releasing a keep_alive=0 group is answered once its ranks are gone: each gets 5 s to exit
# and 5 s more after a SIGKILL (workers/manager/worker_group.py STOP_GRACE_S). Waiting that long
# means an engine's exit frees its GPU memory before the next engine sizes its KV cache.
RELEASE_TIMEOUT_S = 12.0
# A daemon shutting down (idle timeout, `engine-manager stop`) may accept a connection and
# close it unanswered. We wait for it to go, then start a new one: a few tries, a short pause.
MAX_CONNECT_TRIES = 5
# A daemon answers Hello from memory: one that accepts and stays silent this long is stopped
# (SIGSTOP, a debugger) or hung, and waiting on would hang the engine's start with it.
HANDSHAKE_TIMEOUT_S = 15.0
GOING_AWAY_PAUSE_S = 0.1


def manager_command(socket_path: Path, *args: str) -> list[str]:
    # -P keeps the caller's working directory off the daemon's sys.path (and its workers'),
    # so an app's own protocols.py or workers/ package never shadows loomllm's modules.
    return [
        sys.executable,
        "-P",
        "-m",
        "loomllm.workers.manager",
        "--socket",
        str(socket_path),
        *args,
    ]


class _ManagerGoingAway(ManagerError):
    """The manager closed our connection before the handshake was done: it is exiting."""


async def connect_manager(socket_path: Path, role: str = "engine") -> MessageStream:
    """Connect and handshake; a refusal or a broken peer becomes ManagerError (one that
    closed on us mid-handshake, _ManagerGoingAway)."""
    try:
        with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
            return await open_unix_connection(socket_path, role)
    except TimeoutError:
        raise ManagerError(
            f"engine-manager on {socket_path} accepted the connection but did not answer in "
            f"{HANDSHAKE_TIMEOUT_S:g}s: is it stopped or hung? Kill it, and the next engine "
            f"starts a new one"
        ) from None
    except RemoteError as exc:
        raise ManagerError(f"engine-manager on {socket_path} refused: {exc}") from None
    except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        message = f"engine-manager on {socket_path} failed the handshake: {exc!r}"
        raise _ManagerGoingAway(message) from exc
    except ProtocolError as exc:
        message = f"engine-manager on {socket_path} failed the handshake: {exc!r}"
        raise ManagerError(message) from exc


async def connect_shared_manager(socket_path: Path) -> MessageStream:
    """Connect to the per-user daemon, starting it first if nobody answers, or again if
    the one that answered was on its way out.

    Cancellation: nothing is left open; a daemon it started keeps running (shared)."""
    for _ in range(MAX_CONNECT_TRIES):
        try:
            return await connect_manager(socket_path)
        except (FileNotFoundError, ConnectionRefusedError):
            pass  # nobody serves it: start one
        except _ManagerGoingAway:
            # Give it a moment to close its listener, or `start` may still find it
            # answering and start nothing.
            await anyio.sleep(GOING_AWAY_PAUSE_S)
        # Also after a `start` that found a daemon which then went away: start again.
        await _start_shared_manager(socket_path)
    try:
        return await connect_manager(socket_path)
    except OSError as exc:
        raise ManagerError(f"engine-manager started but {socket_path} refuses: {exc}") from exc


async def _start_shared_manager(socket_path: Path) -> None:
    """Run `engine-manager start`: a plain command line, never multiprocessing."""
    with anyio.fail_after(MANAGER_START_TIMEOUT_S):
        # `start` takes the flock and rechecks, so racing engines start one daemon.
        result = await anyio.run_process(
            manager_command(socket_path, "start"), check=False, stdin=subprocess.DEVNULL
        )
    if result.returncode != 0:
        raise ManagerError(
            f"could not start engine-manager on {socket_path}:\n"
            f"{result.stderr.decode(errors='replace').strip()}"
        )


async def list_workers(socket_path: Path) -> list[WorkerInfo]:
    """What the manager at `socket_path` runs (ListWorkers); never starts one."""
    return (await _ask(socket_path, ListWorkers(), WorkerList)).workers


async def list_cached_models(socket_path: Path) -> list[CachedModel]:
    """The hub models in the HF cache of the manager at `socket_path`; never starts one."""
    return (await _ask(socket_path, ListCachedModels(), CachedModelList)).models


async def _ask(socket_path: Path, request: object, reply_type: type[R]) -> R:
    """One request to the manager at `socket_path`, as a CLI client, and its answer.

    Raises ManagerError when no manager answers there. Cancellation: the connection is
    closed, nothing else happened.
    """
    try:
        with anyio.fail_after(REQUEST_TIMEOUT_S):
            ms = await connect_manager(socket_path, "cli")
            async with ms.stream:
                await ms.send(request)
                return await ms.receive_type(reply_type)
    except (FileNotFoundError, ConnectionRefusedError):
        raise ManagerError(f"no engine-manager is running on {socket_path}") from None
    except TimeoutError:
        message = f"engine-manager on {socket_path} did not answer in {REQUEST_TIMEOUT_S:g}s"
        raise ManagerError(message) from None
    except RemoteError as exc:
        raise ManagerError(f"engine-manager on {socket_path} refused: {exc}") from None
    except (ProtocolError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        raise ManagerError(f"engine-manager on {socket_path} failed: {exc!r}") from exc


class PrivateManager:
    """An engine-manager that is our child, serves only us and exits when we disconnect."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="loomllm-")
        self.socket_path = Path(self._tmp.name) / "manager.sock"
        self._process: Process | None = None

    async def __aenter__(self) -> PrivateManager:
        command = manager_command(
            self.socket_path,
            "serve",
            "--exit-with-client",
            "--idle-timeout",
            "-1",
            "--ready-fd",
            "1",
        )
        # A local log file: opening it does not block in any way that matters.
        with open(log_path(self.socket_path), "wb") as log:  # noqa: ASYNC230
            self._process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
        assert self._process.stdout is not None
        try:
            with anyio.fail_after(MANAGER_START_TIMEOUT_S):
                line = b""
                async for chunk in self._process.stdout:
                    line += chunk
                    if b"\n" in line:
                        break
            if line.strip() != b"ready":
                raise ManagerError(f"private engine-manager failed to start:\n{self.log_tail()}")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Cancellation: shielded; the manager (and so its workers) is gone on return."""
        with anyio.CancelScope(shield=True):
            if self._process is not None:
                # It exits by itself once our control connection is closed.
                with anyio.move_on_after(10):
                    await self._process.wait()
                if self._process.returncode is None:
                    self._process.kill()
                await self._process.aclose()
            self._tmp.cleanup()

    def log_tail(self) -> str:
        try:
            return log_path(self.socket_path).read_text(errors="replace")[-3000:]
        except OSError:
            return ""


class ManagerClient:
    """Requests to the manager, one at a time; WorkerDied pushes go to `on_worker_died`.

    Replies and pushed reports share one connection, which `run()` splits.
    """

    def __init__(self, ms: MessageStream, on_worker_died: Callable[[WorkerDied], None]):
        self.ms = ms
        self._on_worker_died = on_worker_died
        self._lock = anyio.Lock()
        self._reply_send, self._reply_receive = anyio.create_memory_object_stream[object](1)
        self._started = False
        self._done = anyio.Event()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the connection until it closes; runs in the engine's task group.

        Cancellation: shielded; it ends when aclose() shuts the connection. An engine left
        by a cancelled scope still releases its workers, and that release needs its reply.
        """
        self._started = True
        task_status.started()
        async with self._reply_send:
            try:
                with anyio.CancelScope(shield=True):
                    await self._read_until_closed()
            finally:
                self._done.set()

    async def _read_until_closed(self) -> None:
        try:
            while True:
                msg = await self.ms.receive()
                if isinstance(msg, WorkerDied):
                    self._on_worker_died(msg)
                else:
                    await self._reply_send.send(msg)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        except ProtocolError as exc:
            logger.error("engine-manager broke the protocol: %s", exc)

    async def request(self, msg: object) -> object:
        async with self._lock:
            await self.ms.send(msg)
            try:
                reply = await self._reply_receive.receive()
            except anyio.EndOfStream:
                raise ManagerError("engine-manager closed the connection") from None
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.kind, reply.message)
        return reply

    async def acquire(self, spec: WorkerSpec, keep_alive: float, engine_id: str) -> WorkersAcquired:
        """Get workers for `spec`: warm ones if the manager has them, else new ones.

        Cancellation: if cancelled while the manager loads, the manager stops the new
        workers when it sees our connection close.
        """
        try:
            with anyio.fail_after(ACQUIRE_TIMEOUT_S):
                reply = await self.request(AcquireWorkers(spec, float(keep_alive), engine_id))
        except RemoteError as exc:
            if exc.kind == "worker_start_failed":
                message = f"could not start workers for {spec.model!r}: {exc}"
                raise WorkerStartError(message) from None
            raise ManagerError(f"engine-manager refused: {exc}") from None
        assert isinstance(reply, WorkersAcquired)
        return reply

    async def pull(
        self,
        model: str,
        revision: str | None,
        token: str | None,
        on_progress: Callable[[PullProgress], None],
        check_hub: bool = False,
    ) -> Pulled:
        """Have the manager download a hub model (or find it cached; `check_hub`: see
        PullModel), calling `on_progress` with each report; ModelPullError with the
        manager's words if it cannot."""
        async with self._lock:
            await self.ms.send(PullModel(model, revision, token, check_hub))
            while True:
                try:
                    reply = await self._reply_receive.receive()
                except anyio.EndOfStream:
                    raise ManagerError("engine-manager closed the connection") from None
                if not isinstance(reply, PullProgress):
                    break
                on_progress(reply)
        if isinstance(reply, ErrorReply):
            raise ModelPullError(reply.message)
        assert isinstance(reply, Pulled)
        return reply

    async def release(self, group_id: str, keep_alive: float | None = None) -> None:
        """Let go of the group, warm for `keep_alive` seconds (None: as acquired)."""
        reply = await self.request(ReleaseWorkers(group_id, keep_alive))
        assert isinstance(reply, Ack)

    async def aclose(self) -> None:
        """Let the reader see EOF and end, then close.

        Cancellation: shielded, bounded by a short timeout.
        """
        self.ms.shutdown()
        if self._started:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._done.wait()
        self._reply_receive.close()
        await anyio.aclose_forcefully(self.ms.stream)
