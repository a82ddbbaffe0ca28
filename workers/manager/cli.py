"""`engine-manager start|stop|status|ps|logs|unload|serve`: the daemon's command line.

`serve` runs the daemon in the foreground; `start` runs `serve` detached. Failure exits non-zero.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import TypeVar

import anyio

from loomllm.protocols.connection import MessageStream, RemoteError, open_unix_connection
from loomllm.protocols.errors import ProtocolError
from loomllm.protocols.messages import (
    CachedModelList,
    ListCachedModels,
    ListWorkers,
    ManagerStatus,
    ShutdownManager,
    StatusRequest,
    Unloaded,
    UnloadModel,
    WorkerList,
)
from loomllm.protocols.rundir import (
    default_socket_path,
    ensure_socket_dir,
    lock_path,
    log_path,
    open_private_file,
)
from loomllm.protocols.worker_table import cached_models_table, format_seconds, ps_table

START_TIMEOUT_S = 30.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_LOG_BYTES = 10 * 1024 * 1024
T = TypeVar("T")


def main(argv: list[str] | None = None) -> None:
    """Run one engine-manager command and exit with its status."""
    args = _parser().parse_args(argv)
    socket_path = Path(args.socket) if args.socket else default_socket_path()
    try:
        code = args.func(args, socket_path)
    except (RemoteError, ProtocolError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
        print(f"engine-manager on {socket_path} refused or failed: {exc!r}", file=sys.stderr)
        code = 1
    sys.exit(code)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-manager", description=__doc__.splitlines()[0])
    p.add_argument("--socket", help="manager socket (default: $LOOM_MANAGER_SOCKET, ...)")
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    for name, func, help_ in [
        ("serve", _cmd_serve, "run the daemon in the foreground"),
        ("start", _cmd_start, "start the daemon in the background; return when ready"),
    ]:
        s = sub.add_parser(name, help=help_)
        s.add_argument(
            "--max-workers", type=_positive_int, default=8, help="cap on worker processes"
        )
        s.add_argument(
            "--max-keep-alive",
            type=_seconds_or_minus_one,
            default=-1,
            help="cap on any engine's keep_alive, seconds (-1: no cap)",
        )
        s.add_argument(
            "--idle-timeout",
            type=_seconds_or_minus_one,
            default=600,
            help="exit when idle this long, seconds (-1: never)",
        )
        s.add_argument("--exit-with-client", action="store_true", help=argparse.SUPPRESS)
        s.add_argument("--allowed-uid", type=int, default=None, help=argparse.SUPPRESS)
        s.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
        s.add_argument("--log-level", type=str.upper, default="INFO", choices=LOG_LEVELS)
        s.set_defaults(func=func)
    sub.add_parser("stop", help="stop the daemon and its workers").set_defaults(func=_cmd_stop)
    sub.add_parser("status", help="is it running? (exit 1 if not)").set_defaults(func=_cmd_status)
    sub.add_parser("ps", help="list workers").set_defaults(func=_cmd_ps)
    sub.add_parser(
        "models", help="list the hub models in the HF cache (what `loom pull` downloaded)"
    ).set_defaults(func=_cmd_models)
    logs = sub.add_parser("logs", help="print the daemon's log")
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true")
    logs.set_defaults(func=_cmd_logs)
    unload = sub.add_parser("unload", help="stop the workers of a model")
    unload.add_argument("model")
    unload.set_defaults(func=_cmd_unload)
    return p


# argparse types: a bad value is exit 2 naming the flag, before any daemon is spawned (its
# errors would only reach the log, or fail every engine later).


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _seconds_or_minus_one(text: str) -> float:
    """Finite seconds >= 0, or -1 (no cap / never). The manager would take any negative
    value or infinity as -1 (and NaN as nonsense): only the documented -1 says so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if value != -1 and not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be seconds >= 0 (finite), or -1; got {text}")
    return value


# -- serve / start ----------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace, socket_path: Path) -> int:
    from loomllm.workers.device.cpu_threads import default_openmp_spin
    from loomllm.workers.manager.daemon import ManagerServer

    default_openmp_spin()  # the zygote and every worker inherit it

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    if _is_running(socket_path):
        logging.error("an engine-manager already serves %s", socket_path)
        return 1
    problem = _socket_path_problem(socket_path)
    if problem:
        logging.error("%s", problem)
        return 1
    server = ManagerServer(
        socket_path,
        max_workers=args.max_workers,
        max_keep_alive=args.max_keep_alive,
        idle_timeout=args.idle_timeout,
        exit_with_client=args.exit_with_client,
        allowed_uid=args.allowed_uid,
    )

    async def run() -> None:
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, server)
            tg.start_soon(_report_ready, ready, args.ready_fd)
            _remove_stale_socket(socket_path)
            await server.serve(ready=ready)
            tg.cancel_scope.cancel()

    try:
        # asyncio, not trio: trio spawns children from a helper thread, and a worker's
        # PR_SET_PDEATHSIG fires when the *thread* that spawned it exits.
        anyio.run(run, backend="asyncio")
    except Exception:
        logging.exception("engine-manager failed")
        return 1
    return 0


async def _stop_on_signal(server: object) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            logging.info("got %s: stopping workers and exiting", signal.Signals(signum).name)
            server.shutdown()  # type: ignore[attr-defined]
            return


async def _report_ready(ready: anyio.Event, fd: int | None) -> None:
    await ready.wait()
    if fd is not None:
        os.write(fd, b"ready\n")
        os.close(fd)


def _socket_path_problem(socket_path: Path) -> str | None:
    """Why a daemon may not bind `socket_path`, or None: something there that is not a
    socket is the user's (a typo in --socket), never ours to delete."""
    try:
        mode = os.lstat(socket_path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISSOCK(mode):
        return None  # a stale socket (nobody answered on it): serve replaces it
    return (
        f"{socket_path} exists and is not a socket; engine-manager will not replace it. "
        "Choose another socket path (--socket or LOOM_MANAGER_SOCKET) or remove that file."
    )


def _remove_stale_socket(socket_path: Path) -> None:
    """Unlink a socket that nobody answered on (_cmd_serve checked); anything else stays."""
    try:
        if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            socket_path.unlink()
    except FileNotFoundError:
        pass


def _cmd_start(args: argparse.Namespace, socket_path: Path) -> int:
    """Launch `serve` detached and return once it listens; under an flock, so that two
    callers starting at once get one daemon."""
    try:
        ensure_socket_dir(socket_path.parent)
        lock_fd = open_private_file(lock_path(socket_path), os.O_RDWR)
    except OSError as exc:
        print(f"engine-manager cannot use {socket_path}: {exc}", file=sys.stderr)
        return 1
    with open(lock_fd, "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second starter waits here, then finds ours
        if _is_running(socket_path):
            print(f"engine-manager already running on {socket_path}")
            return 0
        problem = _socket_path_problem(socket_path)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return _spawn_daemon(args, socket_path)


def _spawn_daemon(args: argparse.Namespace, socket_path: Path) -> int:
    log = log_path(socket_path)
    if log.exists() and log.stat().st_size > MAX_LOG_BYTES:
        log.replace(log.with_suffix(".log.1"))
    read_end, write_end = os.pipe()
    command = [
        sys.executable,
        "-P",
        "-m",
        "loomllm.workers.manager",
        "--socket",
        str(socket_path),
        "serve",
        "--max-workers",
        str(args.max_workers),
        "--max-keep-alive",
        str(args.max_keep_alive),
        "--idle-timeout",
        str(args.idle_timeout),
        "--log-level",
        args.log_level,
        "--ready-fd",
        str(write_end),
    ]
    if args.allowed_uid is not None:
        command += ["--allowed-uid", str(args.allowed_uid)]
    with open(open_private_file(log, os.O_WRONLY | os.O_APPEND), "ab") as log_file:
        # The daemon outlives us: its own session, no stdin, output to its log. We never
        # wait for it; when we exit it is adopted by init, so no zombie is left behind.
        subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            pass_fds=(write_end,),
            start_new_session=True,
        )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as ready:
        answer = ready.readline()  # EOF (b"") if it died before listening
    if answer.strip() != b"ready":
        print(f"engine-manager failed to start; its log ({log}) ends with:", file=sys.stderr)
        print(_tail(log, 20), file=sys.stderr)
        return 1
    print(f"engine-manager started on {socket_path}")
    return 0


# -- client commands --------------------------------------------------------------------


def _request(socket_path: Path, msg: object) -> object:
    async def go() -> object:
        with anyio.fail_after(START_TIMEOUT_S):
            ms: MessageStream = await open_unix_connection(socket_path, "cli")
            async with ms.stream:
                await ms.send(msg)
                return await ms.receive()

    return anyio.run(go)


def _is_running(socket_path: Path) -> bool:
    try:
        return isinstance(_request(socket_path, StatusRequest()), ManagerStatus)
    except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
        return False


def _cmd_status(args: argparse.Namespace, socket_path: Path) -> int:
    try:
        status = _request(socket_path, StatusRequest())
    except OSError:
        print(f"engine-manager is not running (no daemon on {socket_path})")
        return 1
    assert isinstance(status, ManagerStatus)
    print(
        f"engine-manager running: pid {status.pid}, up {status.uptime_s:.0f}s, "
        f"socket {status.socket}\n  clients {status.num_clients}, workers "
        f"{status.num_workers}/{status.max_workers}, max keep-alive "
        f"{format_seconds(status.max_keep_alive)}, "
        f"idle timeout {format_seconds(status.idle_timeout)}"
    )
    return 0


def _ask(socket_path: Path, msg: object, reply_type: type[T]) -> T | None:
    """The daemon's reply to `msg`; None, said on stdout, where no daemon runs."""
    try:
        reply = _request(socket_path, msg)
    except OSError:
        print("engine-manager is not running")
        return None
    assert isinstance(reply, reply_type)
    return reply


def _cmd_ps(args: argparse.Namespace, socket_path: Path) -> int:
    reply = _ask(socket_path, ListWorkers(), WorkerList)
    if reply is None:
        return 1
    print(ps_table(reply.workers))
    return 0


def _cmd_models(args: argparse.Namespace, socket_path: Path) -> int:
    reply = _ask(socket_path, ListCachedModels(), CachedModelList)
    if reply is None:
        return 1
    print(cached_models_table(reply.models))
    return 0


def _cmd_unload(args: argparse.Namespace, socket_path: Path) -> int:
    reply = _ask(socket_path, UnloadModel(args.model), Unloaded)
    if reply is None:
        return 1
    print(f"unloaded {args.model}: {reply.num_workers} worker(s)")
    return 0


def _cmd_stop(args: argparse.Namespace, socket_path: Path) -> int:
    try:
        _request(socket_path, ShutdownManager())
    except OSError:
        print("engine-manager is not running")
        return 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while socket_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the daemon removes its socket as its very last act
    print("engine-manager stopped")
    return 0


def _cmd_logs(args: argparse.Namespace, socket_path: Path) -> int:
    log = log_path(socket_path)
    if not log.exists():
        print(f"no log at {log}", file=sys.stderr)
        return 1
    print(_tail(log, args.lines))
    if args.follow:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            try:
                while True:
                    chunk = f.read()
                    if chunk:
                        sys.stdout.write(chunk.decode("utf-8", "replace"))
                        sys.stdout.flush()
                    else:
                        time.sleep(0.25)
            except KeyboardInterrupt:
                pass
    return 0


def _tail(path: Path, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 200 * lines))
        return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
