"""The zygote: an interpreter with a worker's imports already done, that forks workers.

Importing torch is most of a worker's start, so each rank is a fork that inherits the imports.
Two levels: the zygote the manager starts stays lean (PRELOAD only) and forks the workers of
loomllm's own model; a fork of it, the full zygote, adds transformers' modeling code
(PRELOAD_LATER) and forks every other worker. A lean worker maps none of those pages.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 64 * 1024
# What a worker imports before it can load a model, the slow part of its start: imported
# before the zygote says it is ready.
PRELOAD = (
    "torch",
    "safetensors.torch",
    "loomllm.workers.worker.main",
    "loomllm.workers.models.loader",
    "loomllm.workers.models.llama.model",
    "loomllm.workers.runner.model_runner",
    "loomllm.workers.attention.paged",
    "loomllm.workers.sample.sampler",
    # The CUDA path's kernels (and triton), where triton is installed.
    "loomllm.workers.models.fused_layers",
)
# What only a model outside models/llama/ needs (transformers' modeling code, most of a
# worker's imports) or a GGUF conversion: imported after the zygote is ready, one module at
# a time while no request waits, from shortly after its first fork on (or LATER_AFTER_S
# after it is ready), so that a cold start's first worker is forked without waiting for
# them. A request that comes in during one of them waits for it to end (a data-parallel
# replica's, say, asked for once the previous replica has loaded its model).
PRELOAD_LATER = (
    "transformers",
    # What transformers.modeling_utils imports, in smaller pieces: a request waits for the
    # import under way, so none should take long.
    "sympy",
    "torch.distributed.tensor",
    "torch._dynamo",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "gguf",
)
LATER_AFTER_S = 3.0
# After a fork: time for the other ranks of its group, each asked for once the previous one
# is forked, to come in before an import holds them up.
LATER_AFTER_FORK_S = 0.5


def main(argv: list[str] | None = None) -> None:
    """The zygote's command line; only the manager starts it (manager/zygote_client.py)."""
    p = argparse.ArgumentParser(prog="python -m loomllm.workers.worker.zygote")
    # The manager's directory is only named so that the zygote and every worker forked
    # from it show it in their command line (ps, and the tests' leak checks).
    p.add_argument("--workdir", required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent_pid:
        os._exit(1)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s zygote %(process)d %(levelname)s: %(message)s"
    )
    channel = socket.socket(fileno=args.control_fd)
    for name in PRELOAD:
        preload(name)
    full = fork_full_zygote(channel)
    Zygote(channel, full=full).serve()
    logging.shutdown()
    os._exit(0)  # skips tearing down torch's imports (seconds): nothing else is left to do


def fork_full_zygote(upstream: socket.socket) -> FullZygote | None:
    """Fork the full zygote: a child that serves the requests the lean one passes on, with
    the PRELOAD_LATER imports added while it is idle. None (logged) if the fork failed: the
    lean zygote then forks every worker itself."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lean = os.getpid()
    sys.stdout.flush()  # else what the imports printed is written again by the child
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        logger.exception("could not fork the full zygote: every worker is forked lean")
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        code = 1
        try:
            upstream.close()
            ours.close()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # it dies with the lean zygote
            if os.getppid() != lean:  # which died before prctl took effect
                return None
            Zygote(theirs, later=list(PRELOAD_LATER)).serve()
            code = 0
        except BaseException:
            traceback.print_exc()  # the lean zygote only sees its channel close
        finally:
            logging.shutdown()
            os._exit(code)
    theirs.close()
    return FullZygote(pid, ours)


class FullZygote:
    """The lean zygote's handle on the full one: its pid, its channel, the workers it forked
    that still run, and the requests passed on that it has not answered (both reported
    should it die)."""

    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid = pid
        self.channel = channel
        self.children: set[int] = set()
        self.unanswered = 0


def preload(name: str) -> None:
    """Import `name` for every worker forked after this. A failure is logged: a worker that
    needs the module meets it there, and the zygote (with every worker it forked) lives on."""
    try:
        __import__(name)
    except Exception as exc:  # an optional part, or one broken by a dependency of its own
        logger.info("not preloaded: %s (%s: %s)", name, type(exc).__name__, exc)
    # The imports are every worker's. Frozen before the forks, they are skipped by the
    # workers' full gc collections, which then write to (and so copy) fewer shared pages.
    gc.freeze()


class Zygote:
    """The fork loop: requests from the manager in, children's pids and exits out; the
    `later` imports in between.

    The channel is one end of a SOCK_SEQPACKET socketpair. Each request is a JSON object,
    {"args": the worker's arguments, "full": whether the full zygote forks it}, with two
    file descriptors attached (the rank's lifeline and its log file); the answer is
    {"spawned": pid}, and later {"exited": pid, "code": returncode} for every child that ends
    (a negative code is a signal, as in `subprocess`). EOF from the manager ends the zygote;
    its children die with it (PR_SET_PDEATHSIG), the full zygote and its workers too."""

    def __init__(
        self,
        channel: socket.socket,
        later: list[str] | None = None,
        full: FullZygote | None = None,
    ) -> None:
        self.channel = channel
        self.later = later or []
        # The full zygote the requests for it are passed on to; None: fork them here.
        self.full = full
        # Its pid until it is reaped (after its channel closed, maybe): never a worker's exit.
        self._full_pid = full.pid if full is not None else None
        self.later_from = time.monotonic() + LATER_AFTER_S  # brought forward by a fork
        self.children: set[int] = set()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._importing = False
        # A handler, so the wakeup fd fires; during a later import it reports the exit itself.
        signal.signal(signal.SIGCHLD, self._on_child_exit)
        signal.set_wakeup_fd(self._wake_write)

    def serve(self) -> None:
        """Fork workers on request and report their exits, until the manager goes."""
        selector = selectors.DefaultSelector()
        selector.register(self.channel, selectors.EVENT_READ, "request")
        selector.register(self._wake_read, selectors.EVENT_READ, "child")
        if self.full is not None:
            selector.register(self.full.channel, selectors.EVENT_READ, "full")
        self._send({"ready": os.getpid()})
        while True:
            wait = max(0.0, self.later_from - time.monotonic()) if self.later else None
            events = selector.select(timeout=wait)
            if not events and self.later and time.monotonic() >= self.later_from:
                self._importing = True  # nothing waits: the next of the later imports
                try:
                    preload(self.later.pop(0))
                finally:
                    self._importing = False
            for key, _ in events:
                if key.data == "child":
                    os.read(self._wake_read, 4096)
                    self._reap()
                elif key.data == "full":
                    if not self._relay_full():
                        selector.unregister(key.fileobj)
                elif not self._handle_request():
                    return  # the manager is gone: so are we, and our children with us

    def _handle_request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.channel, MAX_MESSAGE, 2)
        except ConnectionError:
            return False
        if not data:
            return False
        try:
            lifeline, log = fds
            request = json.loads(data)
            worker_args, wants_full = request["args"], request["full"]
        except (ValueError, TypeError, KeyError):
            logger.error("bad request from the manager: %r with fds %s", data[:200], fds)
            for fd in fds:
                os.close(fd)
            self._send({"error": "bad request"})
            return True
        if wants_full and self.full is not None:
            self._pass_on(data, fds)
            return True
        sys.stdout.flush()
        sys.stderr.flush()
        # The fork is safe because the zygote never touches CUDA nor runs a torch op: no
        # CUDA context, no OpenMP pool, no other thread.
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: the manager starts one itself
            logger.error("could not fork a worker: %s", exc)
            os.close(lifeline)
            os.close(log)
            self._send({"error": f"fork failed: {exc}"})
            return True
        if pid == 0:
            self._become_worker(worker_args, lifeline, log)  # never returns
        os.close(lifeline)
        os.close(log)
        self.children.add(pid)
        self.later_from = time.monotonic() + LATER_AFTER_FORK_S
        self._send({"spawned": pid})
        return True

    def _become_worker(self, worker_args: list[str], lifeline: int, log: int) -> None:
        code = 1
        try:
            os.setsid()  # own session and process group, as a freshly started worker has
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            for fd in (null, log, self._wake_read, self._wake_write):
                os.close(fd)
            self.channel.close()
            if self.full is not None:
                self.full.channel.close()
            logging.root.handlers.clear()  # the worker sets up its own
            from loomllm.workers.worker import main as worker

            parent = ["--control-fd", str(lifeline), "--parent-pid", str(os.getppid())]
            worker.main([*worker_args, *parent])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _on_child_exit(self, *_: object) -> None:
        """Python runs this between the bytecodes of whatever the main loop is doing. While
        that is a later import (a second or more), a worker's exit is reported now rather
        than after it: the manager's table, and `engine-manager ps`, stay current. Not
        otherwise: the loop reaps, and a worker's exit never overtakes its "spawned"."""
        if self._importing:
            self._reap()

    def _pass_on(self, data: bytes, fds: list[int]) -> None:
        """A request for the full zygote, sent on as it came; its answer comes back through
        _relay_full (the manager asks for one worker at a time, so answers keep their order)."""
        assert self.full is not None
        try:
            socket.send_fds(self.full.channel, [data], fds)
            self.full.unanswered += 1
        except OSError:
            self._send({"error": "the full zygote is gone"})
        finally:
            for fd in fds:
                os.close(fd)

    def _relay_full(self) -> bool:
        """Pass the full zygote's answers up, keeping count of its workers; False once it is
        gone, whose workers died with it (PR_SET_PDEATHSIG): reported as exited."""
        full = self.full
        assert full is not None
        try:
            data = full.channel.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            logger.warning("the full zygote exited: every worker is forked lean from now on")
            full.channel.close()
            self.full = None
            for _ in range(full.unanswered):  # the manager waits for an answer to each
                self._send({"error": "the full zygote died"})
            for pid in sorted(full.children):
                self._send({"exited": pid, "code": -signal.SIGKILL})
            self._reap()  # it, if it exited before its channel closed
            return False
        message = json.loads(data)
        if "ready" in message:
            logger.info("full zygote pid %d ready", message["ready"])
            return True
        if "spawned" in message or "error" in message:
            full.unanswered -= 1
        if "spawned" in message:
            full.children.add(message["spawned"])
        elif "exited" in message:
            full.children.discard(message["exited"])
        self._send(message)
        return True

    def _reap(self) -> None:
        while self.children or self._full_pid is not None:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self._full_pid:  # its end of the channel closes too: _relay_full tells
                self._full_pid = None
                continue
            self.children.discard(pid)
            self._send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, object]) -> None:
        try:
            self.channel.send(json.dumps(message).encode())
        except OSError:
            pass  # the manager is gone; the next read sees EOF


if __name__ == "__main__":
    main()
