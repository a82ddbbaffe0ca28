"""Who may talk to what: private sockets, SO_PEERCRED refusals (logged), worker leases (only
the engine the manager lent a worker to runs code in it), and `loom serve`'s API key.

Another user is played by a manager or data server told to serve another uid. The
server tests share one `loom serve` (key from LOOM_API_KEY) on the shared manager.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import stat
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import cloudpickle
import httpx
import pytest
from anyio.abc import UNIXSocketStream
from support.servers import loom_serve
from support.sockets import answers_to

from loomllm import LLM, Engine, ManagerError
from loomllm.cli.flags import build_parser
from loomllm.config import EngineConfig
from loomllm.protocols.codec import decode, encode
from loomllm.protocols.connection import (
    MessageStream,
    client_handshake,
    open_unix_connection,
    receive_request,
)
from loomllm.protocols.errors import SilentPeerError
from loomllm.protocols.framing import FrameReader, encode_frame
from loomllm.protocols.messages import (
    Ack,
    AcquireWorkers,
    Attach,
    CallResult,
    ErrorReply,
    Hello,
    ReleaseWorkers,
    RunCallable,
    WorkersAcquired,
)
from loomllm.protocols.peer_auth import peer_credentials, refusal
from loomllm.protocols.rundir import log_path, workers_dir

ENGINE_START_S = 120  # the first engine of a session loads a worker
REPLY_S = 10
API_KEY = "sk-loomtest-4f1d7a2c9b"
MARKER = "zebra7marker"  # a word no log line may carry


def logs_of(manager_socket: Path) -> str:
    """Everything the manager and its workers (and the zygote) have logged."""
    files = [log_path(manager_socket), *sorted(workers_dir(manager_socket).glob("*.log"))]
    return "\n".join(f.read_text(errors="replace") for f in files)


# -- sockets and SO_PEERCRED ------------------------------------------------------------


def test_sockets_are_private(shared_manager, tiny_model) -> None:
    with LLM(tiny_model, manager_socket=shared_manager.socket, dtype="float32") as llm:
        worker_socket = Path(llm.engine._replicas[0].acquired.sockets[0])
    for path, mode in [
        (shared_manager.socket, 0o600),
        (worker_socket, 0o600),
        (shared_manager.socket.parent, 0o700),
        (worker_socket.parent, 0o700),
    ]:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    assert stat.S_ISSOCK(os.stat(worker_socket).st_mode)


def refusal_at(path: Path) -> ErrorReply:
    """What a server says to us on connecting, until it hangs up: one refusal."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_S)
        sock.connect(os.fspath(path))
        reader, bodies = FrameReader(), []
        while data := sock.recv(65536):
            bodies += reader.feed(data)
    [reply] = [decode(body) for body in bodies]
    assert isinstance(reply, ErrorReply), reply
    return reply


def test_manager_refuses_another_uid_and_logs_it(manager, tiny_model) -> None:
    other_uid = os.getuid() + 1
    manager.start("--allowed-uid", str(other_uid))
    try:
        for _ in range(2):  # the second connection proves the daemon is still there
            reply = refusal_at(manager.socket)
            assert reply.kind == "permission_denied"
            assert f"peer uid {os.getuid()} (pid {os.getpid()})" in reply.message
            assert f"serves uid {other_uid} only" in reply.message
        with pytest.raises(ManagerError, match=f"serves uid {other_uid} only"):
            LLM(tiny_model, manager_socket=manager.socket)
        assert refusal_at(manager.socket).kind == "permission_denied"  # still alive
        log = log_path(manager.socket).read_text()
        assert log.count(f"refused connection: peer uid {os.getuid()} (pid {os.getpid()})") == 4
    finally:
        # `engine-manager stop` cannot talk to it either: signal the daemon we started.
        for pid in manager.processes():
            os.kill(pid, signal.SIGTERM)


@pytest.mark.anyio
async def test_worker_refuses_another_uid_and_logs_it(caplog) -> None:
    from loomllm.workers.worker.main import DataServer

    server = DataServer(worker=None, allowed_uid=os.getuid() + 1)  # type: ignore[arg-type]
    a, b = socket.socketpair()
    async with await UNIXSocketStream.from_socket(b) as client:
        with (
            caplog.at_level(logging.WARNING, logger="loomllm.workers.worker.main"),
            anyio.fail_after(5),
        ):
            await server.handle(await UNIXSocketStream.from_socket(a))
            reply = await MessageStream(client).receive()
    assert reply.kind == "permission_denied" and f"serves uid {os.getuid() + 1}" in reply.message
    assert f"refused connection: peer uid {os.getuid()} (pid {os.getpid()})" in caplog.text


@pytest.mark.anyio
async def test_refusal_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    async with await UNIXSocketStream.from_socket(a) as stream:
        with b:
            uid = os.getuid()
            assert peer_credentials(stream) == (os.getpid(), uid, os.getgid())
            assert refusal(stream) is None
            assert refusal(stream, allowed_uid=uid) is None
            why = refusal(stream, allowed_uid=uid + 1)
            assert why == (
                f"peer uid {uid} (pid {os.getpid()}) is not allowed: "
                f"this socket serves uid {uid + 1} only"
            )


@pytest.mark.anyio
async def test_a_silent_client_is_dropped() -> None:
    """Connected, and says nothing: the server gives up on it instead of holding a task and
    an fd forever (the manager and the worker open every conversation this way)."""
    a, b = socket.socketpair()
    async with (
        await UNIXSocketStream.from_socket(a) as server,
        await UNIXSocketStream.from_socket(b),
    ):
        with anyio.fail_after(5), pytest.raises(SilentPeerError, match="no Hello within 0.2 s"):
            await receive_request(MessageStream(server), Hello, within=0.2)


# -- worker leases ----------------------------------------------------------------------


class RecordingWorker:
    """What DataServer needs of a worker, recording the callables it runs."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def reset_session(self) -> None:
        pass


@pytest.mark.anyio
async def test_a_revoked_session_runs_none_of_its_queued_calls() -> None:
    """Calls already in the socket when the lease is revoked stay readable (AF_UNIX keeps
    queued data across shutdown): the worker must not run them for an engine it left."""
    from loomllm.workers.worker.main import DataServer

    worker = RecordingWorker()
    server = DataServer(worker)  # type: ignore[arg-type]
    server.set_lease(b"t1")
    a, b = socket.socketpair()
    async with anyio.create_task_group() as tg, await UNIXSocketStream.from_socket(b) as raw:
        tg.start_soon(server.handle, await UNIXSocketStream.from_socket(a))
        client = MessageStream(raw)
        with anyio.fail_after(5):
            await client_handshake(client, "worker")
            await client.send(Attach(b"t1"))
            assert isinstance(await client.receive(), Ack)
            call = RunCallable(1, cloudpickle.dumps((lambda w: w.ran.append("late"), (), {})))
            b.sendall(client.frame(call))  # no await: the server has not read it yet...
            server.set_lease(b"t2")  # ...when the manager lends the worker to another engine
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await client.receive()
    assert worker.ran == []


async def intrude(path: str, attach: Attach | None, call: RunCallable) -> list[Any]:
    """A same-user client: handshake, `attach` (None: none), `call`; every answer until
    the worker hangs up."""
    msgs = [attach, call] if attach is not None else [call]
    return await answers_to(path, b"".join(encode_frame(encode(m)) for m in msgs), hello_first=True)


async def assert_refused(path: str, token: bytes | None, call: RunCallable) -> None:
    answers = await intrude(path, None if token is None else Attach(token), call)
    assert [type(a) for a in answers] == [ErrorReply], answers
    assert answers[0].kind == ("protocol_error" if token is None else "lease_refused"), answers


@pytest.mark.anyio
async def test_only_the_lease_holder_runs_callables(shared_manager, tiny_model, tmp_path):
    ran = tmp_path / "ran"

    def touch(worker: Any) -> None:
        ran.touch()

    call = RunCallable(1, cloudpickle.dumps((touch, (), {})))
    open_engine = partial(Engine, tiny_model, manager_socket=shared_manager.socket, dtype="float32")
    with anyio.fail_after(ENGINE_START_S):
        async with open_engine() as engine:
            path, pids = engine._replicas[0].acquired.sockets[0], engine.worker_pids
            token = engine._replicas[0].acquired.lease_token
            assert len(token) == 32
            near_misses = [token[:-1] + bytes([token[-1] ^ 1]), token[:16], token + b"\0"]
            for guess in [None, b"", os.urandom(32), *near_misses]:
                await assert_refused(path, guess, call)
            assert await engine.collective_rpc(lambda w: os.getpid()) == pids  # undisturbed
        await assert_refused(path, token, call)  # idle: the lease left with its engine
        async with open_engine() as engine:
            assert engine.reused_warm_workers and engine.worker_pids == pids
            assert engine._replicas[0].acquired.lease_token != token
            await assert_refused(path, token, call)  # the old lease opens nothing
            assert not ran.exists()
            await engine.collective_rpc(touch)  # the owner's call does run
            assert ran.exists()
    logs = logs_of(shared_manager.socket)
    assert "does not hold this worker's current lease" in logs  # refusals are logged
    assert token.hex() not in logs and repr(token)[2:-1] not in logs


@pytest.mark.anyio
async def test_a_released_lease_cuts_its_session_off(shared_manager, tiny_model) -> None:
    config = EngineConfig(model=tiny_model, dtype="float32", manager_socket=shared_manager.socket)
    with anyio.fail_after(ENGINE_START_S):
        control = await open_unix_connection(shared_manager.socket, "engine")
        async with control.stream:
            await control.send(AcquireWorkers(config.worker_spec(), config.keep_alive, "raw"))
            acquired = await control.receive_type(WorkersAcquired)
            data = await open_unix_connection(acquired.sockets[0], "engine")
            async with data.stream:
                await data.send(Attach(acquired.lease_token))
                await data.receive_type(Ack)
                await data.send(RunCallable(7, cloudpickle.dumps((lambda w: 42, (), {}))))
                assert cloudpickle.loads((await data.receive_type(CallResult)).payload) == 42
                await control.send(ReleaseWorkers(acquired.group_id))
                await control.receive_type(Ack)
                # The worker closes our data connection as soon as the lease is gone.
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await data.receive()


# -- loom serve's API key ---------------------------------------------------------------


def test_serve_binds_loopback_and_takes_the_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("LOOM_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.api_key) == ("127.0.0.1", None)
    monkeypatch.setenv("LOOM_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.setenv("LOOM_API_KEY", "")  # set but empty: no key, not the empty key
    assert build_parser().parse_args(["serve"]).api_key is None


@pytest.fixture(scope="module")
def keyed_server(chat_model, shared_manager):
    """`loom serve` with its key in LOOM_API_KEY (only its own environment has it)."""
    stack = ExitStack()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOM_API_KEY", API_KEY)
        server = stack.enter_context(loom_serve(chat_model, shared_manager.socket, "tiny"))
    with stack:
        yield server


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
KEYED = {  # every route outside the open ones, with a body it answers 200 to
    ("GET", "/v1/models"): None,
    ("POST", "/v1/completions"): {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2},
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/tokenize"): {"model": "tiny", "prompt": "w5 w6"},
    ("POST", "/detokenize"): {"model": "tiny", "tokens": [5, 6]},
}
OPEN = ["/health", "/metrics", "/version", "/openapi.json"]
WRONG_KEYS = [
    {},
    {"Authorization": "Bearer nope"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": API_KEY},
    {"Authorization": f"Basic {API_KEY}"},
]
RIGHT_KEY = {"Authorization": f"Bearer {API_KEY}"}


def client_of(server: Any) -> httpx.Client:
    # One kept-alive connection for every request: a 401 must leave it usable (the server
    # reads the refused body first), else a request here meets a closed connection.
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.Client(base_url=server.base_url, timeout=30, limits=one)


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_every_route_but_the_open_ones_needs_the_key(keyed_server) -> None:
    with client_of(keyed_server) as client:
        documented = set(client.get("/openapi.json").json()["paths"])
        assert documented - set(OPEN) == {path for _, path in KEYED}  # none left unchecked
        for (method, path), body in KEYED.items():
            for headers in WRONG_KEYS:
                assert_unauthorized(client.request(method, path, json=body, headers=headers))
            ok = client.request(method, path, json=body, headers=RIGHT_KEY)
            assert ok.status_code == 200, (path, ok.text)
        # The routes /openapi.json does not document yet: the pooling ones and Ollama's.
        for path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/api/generate", "/api/chat"):
            assert_unauthorized(client.post(path, json={"model": "x"}))
        for path in ("/api/embed", "/api/show"):
            assert_unauthorized(client.post(path, json={"model": "x"}))
        for path in ("/api/tags", "/api/ps", "/api/version"):
            assert_unauthorized(client.get(path))
        # Unknown routes too: without the key nobody learns which routes exist.
        assert_unauthorized(client.get("/v1/audio/transcriptions"))
        assert client.get("/v1/audio/transcriptions", headers=RIGHT_KEY).status_code == 404
        for path in OPEN:
            for headers in [{}, WRONG_KEYS[1]]:
                assert client.get(path, headers=headers).status_code == 200, path


def test_a_refused_body_leaves_the_connection_usable(keyed_server) -> None:
    """A refused POST and then a good request, sent back to back on one connection: both are
    answered. Were the 401 sent before the body was read, the server would close the
    connection as the answer ends and the second request would be lost."""
    body = json.dumps({"model": "tiny", "prompt": "w5 " * 300_000}).encode()  # ~1 MB
    refused = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    good = (
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Connection: close\r\n\r\n"
    )
    port = httpx.URL(keyed_server.base_url).port
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(refused + good.encode())
            answer = b"".join(iter(lambda: conn.recv(65536), b""))
        statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
        assert statuses == [b"401", b"200"], answer[:2000]


def test_no_key_and_no_request_body_in_any_log(keyed_server, shared_manager) -> None:
    prompt = f"w5 {MARKER} w6"
    bodies = [
        ("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": prompt}]}),
        ("/tokenize", {"model": "tiny", "prompt": prompt}),
        ("/v1/completions", {"model": MARKER, "prompt": prompt}),  # 404: unknown model
        ("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": MARKER}),  # 400
    ]
    with client_of(keyed_server) as client:
        for path, body in bodies:
            assert_unauthorized(client.post(path, json=body, headers=WRONG_KEYS[2]))
            assert client.post(path, json=body, headers=RIGHT_KEY).status_code in (200, 400, 404)
        not_json = client.post(
            "/v1/completions", content=f'{{"prompt": "{MARKER}', headers=RIGHT_KEY
        )
        assert not_json.status_code == 400
    with open(f"/proc/{keyed_server.pid}/cmdline", "rb") as f:
        assert API_KEY.encode() not in f.read()  # the environment kept it out of `ps`
    for name, text in [
        ("loom serve", keyed_server.output()),
        ("manager and workers", logs_of(shared_manager.socket)),
    ]:
        assert API_KEY not in text, name
        assert MARKER not in text, name
