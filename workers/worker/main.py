"""Worker process main: load the model, report READY to the manager, serve one engine at a time.

It dies with the manager: EOF on its lifeline ends it, and PR_SET_PDEATHSIG is the backstop.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hmac
import logging
import math
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import cloudpickle
from anyio.abc import Listener, SocketStream, UNIXSocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loomllm.protocols.connection import MessageStream, receive_request, server_handshake
from loomllm.protocols.errors import ProtocolError, VersionMismatchError
from loomllm.protocols.framing import DEFAULT_MAX_FRAME_SIZE, OPENING_MAX_FRAME_SIZE
from loomllm.protocols.messages import (
    Ack,
    Attach,
    CallFailed,
    CallResult,
    ErrorReply,
    ExecuteStep,
    Lease,
    RunCallable,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from loomllm.protocols.peer_auth import describe_peer, refusal
from loomllm.protocols.worker_options import WorkerOptions
from loomllm.workers.runner.pending_step import PendingStep
from loomllm.workers.worker.state import Worker

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
ATTACH_WAIT_S = 5.0


def main(argv: list[str] | None = None) -> None:
    """The worker's command line; only the manager starts it (`python -m` or the zygote)."""
    p = argparse.ArgumentParser(prog="python -m loomllm.workers.worker.main")
    p.add_argument("--model", required=True)
    p.add_argument("--options", required=True, help="WorkerOptions, as JSON")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--dist-init-file", required=True)
    p.add_argument("--socket", required=True, help="data socket to listen on")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{args.rank} %(process)d %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(anyio.run(_run, args, backend="trio"))


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the manager died before prctl took effect
        os._exit(1)


async def _run(args: argparse.Namespace) -> int:
    control = MessageStream(
        await UNIXSocketStream.from_socket(socket.socket(fileno=args.control_fd))
    )

    def start() -> Worker:
        return Worker.start(
            args.model,
            WorkerOptions.from_json(args.options),
            args.rank,
            args.world_size,
            f"file://{args.dist_init_file}",
        )

    async def open_listener() -> tuple[Listener[Any], str]:
        return await anyio.create_unix_listener(args.socket, mode=0o600), args.socket

    return await serve_rank(control, args.rank, start, open_listener)


async def serve_rank(
    control: MessageStream,
    rank: int,
    start: Callable[[], Worker],
    open_listener: Callable[[], Awaitable[tuple[Listener[Any], str]]],
) -> int:
    """A rank's life after launch, whatever launched it (the manager, or a Ray actor):
    load (`start`), open the data listener, report READY with its address over `control`,
    serve engines until `control` closes. Returns the exit code."""
    try:
        worker = start()
    except Exception as exc:
        logger.exception("worker failed to start")
        await control.send(WorkerFailed(rank, f"{type(exc).__name__}: {exc}"))
        return 1
    server = DataServer(worker)
    listener, address = await open_listener()
    async with listener:
        await control.send(WorkerReady(rank, os.getpid(), address, worker.model_info))
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, server.handle)
            await _serve_lifeline(control, server)
            logger.info("manager closed our lifeline: exiting")
            tg.cancel_scope.cancel()
    worker.shutdown()
    return 0


async def _serve_lifeline(control: MessageStream, server: DataServer) -> None:
    """Take the manager's leases until it closes the lifeline (or breaks it: same thing)."""
    try:
        while True:
            msg = await control.receive()
            if isinstance(msg, Lease):
                server.set_lease(msg.token)
                await control.send(Ack())
            else:
                logger.warning("ignoring %s on the control socket", type(msg).__name__)
    except (anyio.EndOfStream, anyio.BrokenResourceError, ProtocolError, OSError):
        return


class DataServer:
    """Serves the data socket: one attached engine at a time, calls answered in order.

    Only the holder of the current lease attaches: RunCallable runs cloudpickled code, so
    being the same user is not enough; it must be the engine the manager lent us to.
    """

    def __init__(self, worker: Worker, *, allowed_uid: int | None = None) -> None:
        self.worker = worker
        self.allowed_uid = allowed_uid  # None: our own uid (tests play another user)
        self._lease = b""  # the current lease's token; empty: lent to nobody
        self._attached = anyio.Lock()
        self._session: tuple[MessageStream, bytes] | None = None  # attached, and its token

    def set_lease(self, token: bytes) -> None:
        """The manager's new lease: only its holder attaches from now on, and a session
        attached under an older lease is cut off (its engine no longer owns us)."""
        self._lease = token
        if self._session is not None and not self._is_leased_to(self._session[1]):
            self._session[0].shutdown()

    def _is_leased_to(self, token: bytes) -> bool:
        return bool(self._lease) and hmac.compare_digest(token, self._lease)

    async def handle(self, stream: SocketStream) -> None:
        """Serve one data connection. When its engine goes (closed, crashed or killed), the
        worker drops the engine's state and stays warm for the next one.

        Cancellation: the session's state is dropped as on a disconnect."""
        async with stream:
            # Small frames until the engine has shown the lease token (over TCP, anyone
            # can connect to a Ray rank's data port).
            ms = MessageStream(stream, max_frame_size=OPENING_MAX_FRAME_SIZE)
            why = refusal(stream, self.allowed_uid, allow_tcp=True)
            if why is not None:
                logger.warning("refused connection: %s", why)
                await ms.send_if_open(ErrorReply("permission_denied", why))
                return
            try:
                await server_handshake(ms, "worker")
                attach = await receive_request(ms, Attach)
                if await self._refused(ms, stream, attach.token):
                    return
                # The manager lends us to one engine at a time, but the previous engine's
                # EOF may still be in flight when the next one connects: wait for it.
                attached = False
                with anyio.move_on_after(ATTACH_WAIT_S):
                    await self._attached.acquire()
                    attached = True
                if not attached:
                    await ms.send(ErrorReply("busy", "this worker serves another engine"))
                    return
                try:
                    if await self._refused(ms, stream, attach.token):  # lent again meanwhile
                        return
                    self._session = (ms, attach.token)
                    ms.max_frame_size = DEFAULT_MAX_FRAME_SIZE
                    await ms.send(Ack())
                    await self._serve(ms, attach.token)
                finally:
                    try:
                        if self._session is not None:  # it served: drop its requests
                            self._session = None
                            self.worker.reset_session()
                    finally:
                        self._attached.release()
            except VersionMismatchError as exc:
                logger.warning("refused engine: %s", exc)  # the handshake said why
            except ProtocolError as exc:
                logger.warning("dropping engine connection after protocol error: %s", exc)
                await ms.send_if_open(ErrorReply("protocol_error", str(exc)))
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                logger.info("engine disconnected; state dropped, staying warm")
            except Exception as exc:
                # A bug or an input we did not foresee costs this client, never the worker.
                logger.exception("internal error serving a data connection")
                await ms.send_if_open(ErrorReply("internal_error", f"{type(exc).__name__}: {exc}"))

    async def _refused(self, ms: MessageStream, stream: SocketStream, token: bytes) -> bool:
        """Refuse (and log) a client without the current lease's token; True if refused."""
        if self._is_leased_to(token):
            return False
        logger.warning(
            "refused %s: it does not hold this worker's current lease", describe_peer(stream)
        )
        await ms.send(
            ErrorReply(
                "lease_refused",
                "this worker is lent to another engine (or "
                "to none): attach through the engine-manager",
            )
        )
        return True

    async def _serve(self, ms: MessageStream, token: bytes) -> None:
        # A reader task keeps the inbox: the answerer must see whether the engine has sent
        # the next step already without blocking (or cancelling) a read mid-frame.
        send, inbox = anyio.create_memory_object_stream[object](math.inf)
        error: Exception | None = None
        with send, inbox:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_read_into, ms, send)
                try:
                    await self._answer(ms, inbox, token)
                except Exception as exc:
                    error = exc  # raised below, bare: handle() sorts errors by type
                tg.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _answer(
        self, ms: MessageStream, inbox: MemoryObjectReceiveStream[object], token: bytes
    ) -> None:
        """Answer the calls in order. On CUDA a launched step's reply waits for the next
        step if that arrives before the device is done with this one (async scheduling
        sends it meanwhile): it is launched first, so its forward queues behind this one
        and the device runs it while this step's tokens are copied back and sent.
        Elsewhere a launch computes the whole step: reply at once."""
        runner = self.worker.runner
        launched: _Launched | None = None  # launched, reply not sent yet
        while True:
            if launched is not None:
                msg = None
                if runner.overlap_launches:
                    msg = await _next_before_done(inbox, launched.step)
                if msg is None:
                    await ms.send(self._reply(launched))
                    launched = None
                    continue
            else:
                msg = await inbox.receive()
            if isinstance(msg, BaseException):
                # The connection is over (EOF, or a protocol error that ends it): a launched
                # step's reply would have nobody to read it.
                raise msg
            # Calls the engine queued before its lease was revoked are still readable after
            # set_lease's shutdown: none of them runs.
            if not self._is_leased_to(token):
                logger.info("the attached engine's lease ended: dropping its session")
                return
            if isinstance(msg, ExecuteStep):
                step = self._launch(msg)
                if launched is not None:
                    await ms.send(self._reply(launched))
                if isinstance(step, CallFailed):
                    await ms.send(step)
                    launched = None
                else:
                    launched = step
                continue
            if launched is not None:
                await ms.send(self._reply(launched))
                launched = None
            if isinstance(msg, RunCallable):
                await ms.send(self._run_callable(msg))
            else:
                await ms.send(
                    ErrorReply("bad_request", f"a worker does not take {type(msg).__name__}")
                )

    def _launch(self, msg: ExecuteStep) -> _Launched | CallFailed:
        start = time.perf_counter()
        governor = self.worker.cpu_threads
        try:
            with governor.step() if governor is not None else contextlib.nullcontext():
                step = self.worker.runner.launch(msg.scheduler_output, msg.call_id)
        except Exception as exc:
            return self._failed(msg.call_id, msg.scheduler_output.step_id, exc)
        return _Launched(msg, step, time.perf_counter() - start)

    def _reply(self, launched: _Launched) -> StepResult | CallFailed:
        """The launched step's result, once its tokens are on the host."""
        start = time.perf_counter()
        try:
            result = launched.step.result()
        except Exception as exc:
            return self._failed(launched.msg.call_id, launched.msg.scheduler_output.step_id, exc)
        worker_s = launched.launch_s + time.perf_counter() - start
        return dataclasses.replace(result, worker_time_s=worker_s)

    def _failed(self, call_id: int, step_id: int, exc: Exception) -> CallFailed:
        logger.exception("step %d failed", step_id, exc_info=exc)
        # The step's requests are failed by the engine; our batch state is suspect.
        self.worker.runner.reset()
        return CallFailed(call_id, type(exc).__qualname__, str(exc), traceback.format_exc())

    def _run_callable(self, msg: RunCallable) -> CallResult | CallFailed:
        # Runs on the event loop thread on purpose: model work is this process's only job,
        # and the same thread keeps CUDA's per-thread state (current device, stream) stable.
        try:
            fn, args, kwargs = cloudpickle.loads(msg.payload)
            return CallResult(msg.call_id, cloudpickle.dumps(fn(self.worker, *args, **kwargs)))
        except Exception as exc:
            return CallFailed(msg.call_id, type(exc).__qualname__, str(exc), traceback.format_exc())


@dataclass(eq=False, slots=True)
class _Launched:
    msg: ExecuteStep
    step: PendingStep
    launch_s: float  # the launch's share of the worker's time for this step


async def _read_into(ms: MessageStream, inbox: MemoryObjectSendStream[object]) -> None:
    """Every message from the engine into `inbox`, then what ended the connection."""
    try:
        while True:
            inbox.send_nowait(await ms.receive())
    except Exception as exc:
        inbox.send_nowait(exc)


async def _next_before_done(
    inbox: MemoryObjectReceiveStream[object], step: PendingStep
) -> object | None:
    """The next message if it arrives before the device is done with `step`, else None
    (the step's reply is due: the engine may be waiting for it to send anything more)."""
    try:
        return inbox.receive_nowait()  # sent already: no race to run
    except anyio.WouldBlock:
        pass
    arrived: list[object] = []
    async with anyio.create_task_group() as tg:

        async def next_message() -> None:
            arrived.append(await inbox.receive())  # cancel-safe: a whole message or none
            tg.cancel_scope.cancel()

        async def device_done() -> None:
            # A blocking CUDA wait, in a thread so that a message can win the race; an
            # abandoned wait ends by itself with the step.
            await anyio.to_thread.run_sync(step.wait, abandon_on_cancel=True)
            tg.cancel_scope.cancel()

        tg.start_soon(next_message)
        tg.start_soon(device_done)
    return arrived[0] if arrived else None


if __name__ == "__main__":
    main()
