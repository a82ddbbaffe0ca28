"""A worker rank inside a Ray actor: the life of a local rank (worker/main.py), over TCP.

The manager wraps RankActor with ray.remote, so this module imports no ray at module level.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
from typing import Any

import anyio
from anyio.abc import Listener, SocketAttribute, SocketListener, SocketStream, TaskGroup

from loomllm.protocols.connection import MessageStream, tcp_address
from loomllm.protocols.framing import DEFAULT_MAX_FRAME_SIZE, OPENING_MAX_FRAME_SIZE
from loomllm.protocols.messages import Attach
from loomllm.protocols.worker_options import WorkerOptions

logger = logging.getLogger(__name__)

# The manager connects right after `serve()` is called; a stranger that connects first and
# says nothing, or the wrong thing, is dropped.
LIFELINE_WAIT_S = 60.0
OPENING_WAIT_S = 5.0


class RankActor:
    """One rank of a Ray-placed worker group.

    The manager (manager/ray_group.py) calls `bind()`, then `serve()`, which runs until it
    closes the lifeline: a TCP socket on this node that it opens with a secret only it was
    given. Engines attach to the data port, also TCP, with their lease token."""

    def __init__(self) -> None:
        self.host = ""
        self._lifeline: socket.socket | None = None

    def bind(self, reserve_dist_port: bool) -> tuple[str, int, int, int]:
        """(this node's address, the lifeline's port, a free port for torch.distributed's
        rendezvous if asked (rank 0) else 0, our pid)."""
        import ray

        self.host = ray.util.get_node_ip_address()
        self._lifeline = socket.create_server((self.host, 0))
        dist_port = 0
        if reserve_dist_port:
            with socket.create_server((self.host, 0)) as probe:
                dist_port = probe.getsockname()[1]
        return self.host, self._lifeline.getsockname()[1], dist_port, os.getpid()

    def serve(
        self,
        model: str,
        options_json: str,
        rank: int,
        world_size: int,
        dist_init_method: str,
        secret: bytes,
    ) -> int:
        """Run the rank until the manager closes its lifeline; the exit code."""
        assert self._lifeline is not None, "bind() first"
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s rank{rank} %(process)d %(levelname)s %(name)s: %(message)s",
        )
        try:
            return anyio.run(
                _serve,
                self._lifeline,
                self.host,
                secret,
                model,
                options_json,
                rank,
                world_size,
                dist_init_method,
                backend="trio",
            )
        finally:
            self._lifeline.close()  # a manager still waiting to be accepted sees it at once


# Not a method: Ray makes an actor with any `async def` method an asyncio actor, whose
# methods may run concurrently and inside Ray's own event loop.
async def _serve(
    lifeline: socket.socket,
    host: str,
    secret: bytes,
    model: str,
    options_json: str,
    rank: int,
    world_size: int,
    dist_init_method: str,
) -> int:
    from loomllm.workers.worker.main import serve_rank
    from loomllm.workers.worker.state import Worker

    control = await accept_lifeline(await SocketListener.from_socket(lifeline), secret)

    def start() -> Worker:
        options = WorkerOptions.from_json(options_json)
        return Worker.start(model, options, rank, world_size, dist_init_method)

    async def open_listener() -> tuple[Listener[Any], str]:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
        return listener, tcp_address(host, listener.extra(SocketAttribute.local_port))

    async with control.stream:
        return await serve_rank(control, rank, start, open_listener)


async def accept_lifeline(listener: SocketListener, secret: bytes) -> MessageStream:
    """The first connection whose opening Attach carries `secret`: the manager's.

    Each connection is vetted in a task of its own, so strangers that connect and say
    nothing cannot hold the manager's turn; whatever they send, they are only dropped.
    """
    chosen: list[MessageStream] = []

    async def vet(stream: SocketStream, tg: TaskGroup) -> None:
        ms = MessageStream(stream, max_frame_size=OPENING_MAX_FRAME_SIZE)
        try:
            with anyio.fail_after(OPENING_WAIT_S):
                opening = await ms.receive()
            if isinstance(opening, Attach) and hmac.compare_digest(opening.token, secret):
                ms.max_frame_size = DEFAULT_MAX_FRAME_SIZE
                chosen.append(ms)
                tg.cancel_scope.cancel()
                return
        except Exception:  # anything a stranger sends only gets it dropped
            pass
        finally:
            if ms not in chosen:  # also when cancelled: the manager got in first
                await anyio.aclose_forcefully(stream)
        logger.warning("dropped a lifeline connection without the manager's secret")

    async with listener:
        with anyio.fail_after(LIFELINE_WAIT_S):
            async with anyio.create_task_group() as tg:
                while True:
                    tg.start_soon(vet, await listener.accept(), tg)
    return chosen[0]
