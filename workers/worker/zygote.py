"""The zygote: an interpreter with a worker's imports already done, that forks workers.

Importing torch is most of a worker's start, so each rank is a fork that inherits the imports.
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
    Zygote(channel, later=list(PRELOAD_LATER)).serve()
    logging.shutdown()
    os._exit(0)  # skips tearing down torch's imports (seconds): nothing else is left to do


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

    The channel is one end of a SOCK_SEQPACKET socketpair. Each request is a JSON list of
    worker arguments with two file descriptors attached (the rank's lifeline and its log
    file); the answer is {"spawned": pid}, and later {"exited": pid, "code": returncode}
    for every child that ends (a negative code is a signal, as in `subprocess`). EOF from
    the manager ends the zygote; its children die with it (PR_SET_PDEATHSIG)."""

    def __init__(self, channel: socket.socket, later: list[str] | None = None) -> None:
        self.channel = channel
        self.later = later or []
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
            worker_args = json.loads(data)
        except ValueError:
            logger.error("bad request from the manager: %r with fds %s", data[:200], fds)
            for fd in fds:
                os.close(fd)
            self._send({"error": "bad request"})
            return True
        sys.stdout.flush()
        sys.stderr.flush()
        # The fork is safe because the zygote never touches CUDA nor runs a torch op: no
        # CUDA context, no OpenMP pool, no other thread.
        pid = os.fork()
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

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, object]) -> None:
        try:
            self.channel.send(json.dumps(message).encode())
        except OSError:
            pass  # the manager is gone; the next read sees EOF


if __name__ == "__main__":
    main()
