"""Worker process main: load the model, report READY to the manager, serve one engine at a time.

Started only by the manager (`python -m workers.worker ...`). It dies with the manager:
EOF on its lifeline socket ends it cleanly, PR_SET_PDEATHSIG is the backstop. When its
engine disconnects (closed, crashed or killed) it drops that engine's state and stays
warm for the next one.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback

import anyio
import cloudpickle
from anyio.abc import SocketStream, UNIXSocketStream

from protocols.connection import MessageStream, server_handshake
from protocols.errors import ProtocolError, VersionMismatchError
from protocols.messages import (
    CallFailed,
    CallResult,
    ErrorReply,
    ExecuteStep,
    RunCallable,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from workers.peer_auth import refusal
from workers.worker_state import Worker

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
ATTACH_WAIT_S = 5.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workers.worker")
    p.add_argument("--model", required=True)
    p.add_argument("--options", default="{}", help="JSON: dtype, device, ...")
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
    try:
        worker = Worker.start(
            args.model, json.loads(args.options), args.rank, args.world_size,
            args.dist_init_file,
        )  # fmt: skip
    except Exception as exc:
        logger.exception("worker failed to start")
        await control.send(WorkerFailed(args.rank, f"{type(exc).__name__}: {exc}"))
        return 1
    server = DataServer(worker)
    async with await anyio.create_unix_listener(args.socket, mode=0o600) as listener:
        await control.send(WorkerReady(args.rank, os.getpid(), args.socket, worker.model_info))
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, server.handle)
            await _wait_for_eof(control)
            logger.info("manager closed our lifeline: exiting")
            tg.cancel_scope.cancel()
    worker.shutdown()
    return 0


async def _wait_for_eof(control: MessageStream) -> None:
    try:
        while True:
            msg = await control.receive()
            logger.warning("ignoring %s on the control socket", type(msg).__name__)
    except (anyio.EndOfStream, anyio.BrokenResourceError, ProtocolError, OSError):
        return


class DataServer:
    """Serves the data socket: one attached engine at a time, calls answered in order."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._attached = anyio.Lock()

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            ms = MessageStream(stream)
            why = refusal(stream)
            if why is not None:
                logger.warning("refused connection: %s", why)
                await _try_send(ms, ErrorReply("permission_denied", why))
                return
            try:
                await server_handshake(ms, "worker")
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
                    await self._serve(ms)
                finally:
                    self.worker.reset_session()
                    self._attached.release()
            except VersionMismatchError as exc:
                logger.warning("refused engine: %s", exc)  # the handshake said why
            except ProtocolError as exc:
                logger.warning("dropping engine connection after protocol error: %s", exc)
                await _try_send(ms, ErrorReply("protocol_error", str(exc)))
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                logger.info("engine disconnected; state dropped, staying warm")

    async def _serve(self, ms: MessageStream) -> None:
        while True:
            msg = await ms.receive()
            if isinstance(msg, ExecuteStep):
                reply = self._execute_step(msg)
            elif isinstance(msg, RunCallable):
                reply = self._run_callable(msg)
            else:
                reply = ErrorReply("bad_request", f"a worker does not take {type(msg).__name__}")
            await ms.send(reply)

    def _execute_step(self, msg: ExecuteStep) -> StepResult | CallFailed:
        try:
            start = time.perf_counter()
            result = self.worker.runner.execute(msg.scheduler_output, msg.call_id)
            return dataclasses.replace(result, worker_time_s=time.perf_counter() - start)
        except Exception as exc:
            logger.exception("step %d failed", msg.scheduler_output.step_id)
            # The step's requests are failed by the engine; our batch state is suspect.
            self.worker.runner.reset()
            return CallFailed(msg.call_id, type(exc).__qualname__, str(exc), traceback.format_exc())

    def _run_callable(self, msg: RunCallable) -> CallResult | CallFailed:
        # Runs on the event loop thread on purpose: model work is this process's only job,
        # and the same thread keeps CUDA's per-thread state (current device, stream) stable.
        try:
            fn, args, kwargs = cloudpickle.loads(msg.payload)
            return CallResult(msg.call_id, cloudpickle.dumps(fn(self.worker, *args, **kwargs)))
        except Exception as exc:
            return CallFailed(msg.call_id, type(exc).__qualname__, str(exc), traceback.format_exc())


async def _try_send(ms: MessageStream, msg: object) -> None:
    try:
        await ms.send(msg)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


if __name__ == "__main__":
    main()
