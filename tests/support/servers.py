"""Servers for tests: the OpenAI app in-process over an Engine (`running`), or a real
`loom serve` subprocess on a free loopback port (`loom_serve`); and reading their answers."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

from loomllm import Engine
from loomllm.server import build_app, serve


@dataclass(frozen=True, slots=True)
class LoomServer:
    base_url: str  # http://127.0.0.1:PORT
    port: int
    pid: int
    proc: subprocess.Popen
    log_path: Path  # its stdout and stderr

    def output(self) -> str:
        return self.log_path.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """The process's resident set size (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@contextmanager
def loom_serve(
    model: str,
    manager_socket: Path,
    name: str,
    loop: str = "asyncio",
    *args: str,
    start_timeout: float = 60,
    cwd: Path | None = None,
) -> Iterator[LoomServer]:
    """Start `loom serve` (more flags in `args`), wait for /health, yield; then, unless it
    has exited already (the test checks that itself), SIGTERM it and check it exits 0.
    """
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("loom")),  # the console script, as a user runs it
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--loop",
        loop,
        "--manager-socket",
        str(manager_socket),
        *args,
    ]
    # Output goes to a file, not a pipe: a long test could fill a pipe nobody reads.
    log_path = Path(manager_socket).parent / f"serve-{port}.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + start_timeout
            while True:
                assert proc.poll() is None, _tail(log)
                try:
                    if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "loom serve did not come up: " + _tail(log)
                time.sleep(0.1)
            yield LoomServer(base, port, proc.pid, proc, log_path)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0, _tail(log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


NAME = "tiny"


@asynccontextmanager
async def running(model: str, manager, engine_options: dict | None = None, **app_options):
    """(engine, client) with the app served by hypercorn on a free port in this task group."""
    async with Engine(
        model, manager_socket=manager.socket, dtype="float32", **(engine_options or {})
    ) as engine:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        bind = f"fd://{sock.detach()}"
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve, build_app(engine, NAME, **app_options), bind, stop.wait)
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                with anyio.fail_after(10):
                    while True:  # the server accepts as soon as it listens
                        try:
                            await client.get("/version")
                            break
                        except httpx.ConnectError:
                            await anyio.sleep(0.02)
                yield engine, client
            stop.set()


async def sse_events(response: httpx.Response) -> list:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if param is not None:
        assert param in error["message"]
    return error
