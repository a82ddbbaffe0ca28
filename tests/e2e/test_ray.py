"""distributed_executor_backend="ray": a Ray cluster of two nodes on loopback (127.0.0.2, the
head and the engine-manager's node, and 127.0.0.3), one CPU each, so a group of two ranks
spans both. TP=2 there gives the greedy tokens of one local rank; a killed rank is an
EngineDeadError as locally; a missing cluster and a missing Ray are clear errors.

Skipped, with the reason, when Ray is not installed or its nodes cannot start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketListener
from support.managers import new_manager_handle, pids_mentioning
from support.models import make_tiny_model
from support.servers import free_port

from loomllm import LLM, EngineDeadError, WorkerStartError
from loomllm.protocols.connection import MessageStream
from loomllm.protocols.messages import Ack, Attach, ErrorReply
from loomllm.protocols.sampling import SamplingParams
from loomllm.workers.worker.ray_rank import accept_lifeline

# Processes that need both cores at once: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
HOST = "127.0.0.1"
PROMPTS = ["w5 w6 w7", "w9 " * 40, "w11", "w3 w200 w17 w4"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Two Ray nodes on loopback; yields the head's address; every Ray process is gone after."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed: pip install 'loomllm[ray]'")
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray puts sockets there
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": "lo",
    }  # gloo's rendezvous between the "nodes" stays on lo
    port = free_port()
    # Each node's object store would take a share of all memory (/dev/shm) by default.
    common = [
        "--num-cpus=1",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--object-store-memory=100000000",
    ]
    started = []
    try:
        for args in (
            [
                "--head",
                f"--node-ip-address={HEAD_IP}",
                f"--port={port}",
                "--include-dashboard=false",
            ],
            [f"--address={HEAD_IP}:{port}", f"--node-ip-address={NODE_IP}"],
        ):
            result = subprocess.run(
                [ray_cli(), "start", *args, *common],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            started.append(result)
            if result.returncode != 0:
                pytest.skip(f"Ray could not start a node: {result.stderr[-1500:]}")
        yield f"{HEAD_IP}:{port}"
    finally:
        kill_tree(pids_mentioning(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def kill_tree(roots: list[int]) -> None:
    """SIGKILL these processes and every descendant (Ray's agents and actors: their command
    lines do not name the temp dir), children first found, then all killed."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def ray_env(ray_cluster, monkeypatch):
    """The engine finds the cluster as a user's would: RAY_ADDRESS, and this machine's
    address in it (the manager is a driver on the head's node)."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("LOOM_HOST_IP", HEAD_IP)
    handle = new_manager_handle()
    yield handle
    handle.stop_and_check_clean()


def test_tp2_across_two_ray_nodes_gives_one_local_ranks_tokens(tmp_path, ray_env):
    model = make_tiny_model(tmp_path, "llama")
    options = dict(
        keep_alive=0, dtype="float32", max_num_batched_tokens=32, manager_socket=ray_env.socket
    )
    with LLM(model, **options) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    started = time.monotonic()
    with LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **options) as llm:
        startup = time.monotonic() - started
        sockets = llm.engine._replicas[0].acquired.sockets
        assert all(s.startswith("tcp://127.0.0.") for s in sockets), sockets
        nodes = llm.collective_rpc(lambda w: __import__("ray").get_runtime_context().get_node_id())
        assert len(set(nodes)) == 2, "the two ranks share a node"
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == expected
    assert startup < 120, startup


def test_a_killed_ray_rank_is_an_engine_death(tmp_path, ray_env):
    model = make_tiny_model(tmp_path, "llama")
    with pytest.raises(EngineDeadError, match="rank 1"):
        with LLM(
            model,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            keep_alive=0,
            dtype="float32",
            manager_socket=ray_env.socket,
        ) as llm:
            os.kill(llm.engine.worker_pids[1], signal.SIGKILL)
            llm.generate(["w5 w6"], SamplingParams(max_tokens=200), use_tqdm=False)


@pytest.mark.anyio
async def test_a_ray_ranks_lifeline_admits_only_the_managers_secret():
    """Strangers on the lifeline port (silent, an ErrorReply, a wrong secret, a huge frame)
    are dropped, each on its own; the manager's connection is the one taken."""
    secret = b"s" * 32
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    chosen: list[MessageStream] = []

    async def accept() -> None:
        chosen.append(await accept_lifeline(await SocketListener.from_socket(sock), secret))

    async with AsyncExitStack() as stack:
        strangers = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            for opening in (None, ErrorReply("x", "y"), Attach(b"w" * 32), b"\0" * 8192):
                stream = await stack.enter_async_context(await anyio.connect_tcp(HOST, port))
                strangers.append(stream)
                if isinstance(opening, bytes):  # a header announcing a frame too big
                    await stream.send(len(opening).to_bytes(4, "big") + opening[:16])
                elif opening is not None:
                    await MessageStream(stream).send(opening)
            manager = MessageStream(
                await stack.enter_async_context(await anyio.connect_tcp(HOST, port))
            )
            await manager.send(Attach(secret))
        lifeline = chosen[0]
        stack.push_async_callback(lifeline.stream.aclose)
        await lifeline.send(Ack())
        assert isinstance(await manager.receive(), Ack)
        for stream in strangers:  # each was dropped (closed, or reset if it had sent more)
            with (
                anyio.fail_after(10),
                pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)),
            ):
                await stream.receive()


def test_no_ray_cluster_is_a_clear_error(tiny_model, monkeypatch, manager):
    monkeypatch.setenv("RAY_ADDRESS", f"{HEAD_IP}:{free_port()}")  # nobody there
    with pytest.raises(WorkerStartError, match="no Ray cluster answers at address="):
        LLM(
            tiny_model,
            distributed_executor_backend="ray",
            keep_alive=0,
            manager_socket=manager.socket,
        )


def test_no_ray_installed_is_a_clear_error(tiny_model, tmp_path, monkeypatch, manager):
    # A manager whose Python cannot import ray: a `ray` package on its path that refuses.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    manager.start()
    with pytest.raises(WorkerStartError, match=r"needs Ray .*pip install 'loomllm\[ray\]'"):
        LLM(
            tiny_model,
            distributed_executor_backend="ray",
            keep_alive=0,
            manager_socket=manager.socket,
        )
