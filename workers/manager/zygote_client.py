"""The manager's side of the zygote (worker/zygote.py): start it, ask it for workers, see them end.

If the zygote cannot start or dies, the manager launches fresh interpreters until a new one runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL

import anyio
from anyio.abc import Process

from loomllm.protocols.messages import WorkerSpec
from loomllm.workers.models.sources import ModelLoadError, resolve_model

logger = logging.getLogger(__name__)
# Set to 0 to start every worker as a fresh interpreter (slower; for debugging).
ENV_SWITCH = "LOOM_WORKER_ZYGOTE"
ZYGOTE_DIED = -9  # the exit code given to children still running when the zygote died


class ForkedProcess:
    """A worker forked by the zygote: its exit status comes from the zygote, not waitpid.

    It offers the part of anyio's `Process` that the manager uses (pid, wait, returncode,
    aclose)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = anyio.Event()

    def set_exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def aclose(self) -> None:
        await self.wait()


class ZygoteClient:
    """One zygote process at a time; `run()` (re)starts it on demand and pumps its replies."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.enabled = os.environ.get(ENV_SWITCH, "1") != "0"
        self._channel: socket.socket | None = None
        self._process: Process | None = None
        self._children: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}  # exits reported before spawn() saw the pid
        self._pending: list[_Pending] = []  # spawn() calls waiting for a pid, in order
        self._lock = anyio.Lock()
        self._wanted = anyio.Event()

    async def run(self) -> None:
        """Keep a zygote while the manager runs (started when first wanted, and again after
        it dies); on the way out, its children are told they ended."""
        if not self.enabled:
            return
        while True:
            await self._wanted.wait()
            await self._run_one()
            self._wanted = anyio.Event()

    def want(self) -> None:
        """Start the zygote now (its imports take seconds): the manager calls this at start."""
        self._wanted.set()

    async def spawn(
        self, worker_args: list[str], lifeline: int, log: int, *, full: bool = True
    ) -> ForkedProcess | None:
        """Fork a worker with these arguments (without --control-fd and --parent-pid), from
        the full zygote (transformers' modeling code imported) or the lean one.

        None when the zygote cannot start or died: the caller launches a fresh interpreter,
        and the next call starts a new zygote."""
        if not self.enabled:
            return None
        self.want()
        async with self._lock:
            while self._channel is None:  # the zygote is starting: wait until ready, or ended
                await anyio.sleep(0.01)
                if not self._wanted.is_set():
                    return None  # it could not start, or died while starting
            pending = _Pending()
            self._pending.append(pending)
            try:
                request = json.dumps({"args": worker_args, "full": full}).encode()
                await _send_fds(self._channel, request, [lifeline, log])
            except OSError:
                self._pending.remove(pending)
                return None
            await pending.done.wait()
        if pending.pid is None:
            return None
        pid = pending.pid
        child = ForkedProcess(pid)
        self._children[pid] = child
        if pid in self._exits:
            child.set_exited(self._exits.pop(pid))
        return child

    async def _run_one(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        command = [
            sys.executable,
            "-P",
            "-m",
            "loomllm.workers.worker.zygote",
            "--workdir",
            str(self.workdir),
            "--control-fd",
            str(theirs.fileno()),
            "--parent-pid",
            str(os.getpid()),
        ]
        try:
            with open(self.workdir / "zygote.log", "ab") as log:  # noqa: ASYNC230
                self._process = await anyio.open_process(
                    command,
                    stdin=DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        except OSError:
            logger.exception("could not start the zygote: workers start as fresh interpreters")
            ours.close()
            return
        finally:
            theirs.close()
        try:
            await self._pump(ours)
        finally:
            self._channel = None
            ours.close()
            for pending in self._pending:
                pending.done.set()  # no pid: the caller starts a fresh interpreter
            self._pending.clear()
            for child in self._children.values():
                child.set_exited(ZYGOTE_DIED)  # PR_SET_PDEATHSIG took them with it
            self._children.clear()
            with anyio.CancelScope(shield=True):
                await _reap(self._process)
            self._process = None

    async def _pump(self, channel: socket.socket) -> None:
        while True:
            await anyio.wait_readable(channel)
            try:
                data = channel.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                logger.warning("the zygote exited; the next worker starts a new one")
                return
            message = json.loads(data)
            if "ready" in message:
                logger.info("zygote pid %d ready", message["ready"])
                self._channel = channel
            elif "exited" in message:
                pid, code = message["exited"], message["code"]
                child = self._children.pop(pid, None)
                if child is None:
                    self._exits[pid] = code
                else:
                    child.set_exited(code)
            else:
                pending = self._pending.pop(0)
                pending.pid = message.get("spawned")
                pending.done.set()


def needs_full_zygote(spec: WorkerSpec) -> bool:
    """Whether the spec's workers may run transformers' modeling code, and so are forked from
    the full zygote. Only loomllm's own model on a GGUF file is known not to: a worker forked
    lean that needs it after all imports it itself (a slower start, the same answers)."""
    options = spec.options
    if options.model_impl == "transformers" or options.runner != "generate" or options.max_loras:
        return True
    try:  # the worker's own lookup (an alias or a .gguf file; nothing is fetched)
        return resolve_model(spec.model, options.revision).kind != "gguf"
    except (ModelLoadError, OSError):
        return True  # the worker says what is wrong, wherever it is forked


@dataclass(eq=False)
class _Pending:
    done: anyio.Event = field(default_factory=anyio.Event)
    pid: int | None = None


async def _send_fds(channel: socket.socket, data: bytes, fds: list[int]) -> None:
    while True:
        try:
            socket.send_fds(channel, [data], fds)
            return
        except BlockingIOError:
            await anyio.wait_writable(channel)


async def _reap(process: Process) -> None:
    """The zygote exits on EOF from us; kill it if it does not."""
    with anyio.move_on_after(5):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
    await process.aclose()
