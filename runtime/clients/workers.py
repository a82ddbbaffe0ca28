"""One engine's data connections to its worker ranks: send a call to every rank, gather replies.

Each rank has a reader task; a rank whose connection ends fails every pending and later call.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from loomllm.errors import EngineDeadError, ManagerError
from loomllm.protocols.connection import MessageStream, RemoteError, open_connection
from loomllm.protocols.errors import ProtocolError
from loomllm.protocols.messages import Ack, Attach, CallFailed, CallResult, ErrorReply, StepResult

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
DEATH_REPORT_WAIT_S = 1.0
Reply = CallResult | CallFailed | StepResult
# What a rank that refuses us, is gone, or dies while we attach raises from the handshake.
_ATTACH_ERRORS = (
    OSError,
    RemoteError,
    TimeoutError,
    ProtocolError,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
)


@dataclass(eq=False)
class _PendingCall:
    replies: list[Reply | None]
    done: anyio.Event = field(default_factory=anyio.Event)
    remaining: int = 0


class WorkerClient:
    """Calls to all ranks of one worker group, answered in rank order.

    Once a rank's connection ends or breaks, `fail()` makes the whole client dead: every
    pending and later call raises EngineDeadError.
    """

    def __init__(self, ranks: list[MessageStream]) -> None:
        self.ranks = ranks
        self.dead: EngineDeadError | None = None
        self._dead_event = anyio.Event()
        self._closing = False
        self._readers_done: list[anyio.Event] = []
        self._pending: dict[int, _PendingCall] = {}
        self._call_ids = itertools.count(1)

    @classmethod
    async def connect(cls, sockets: list[str], lease_token: bytes) -> WorkerClient:
        """Attach to every rank with the lease token from WorkersAcquired (they admit only
        its holder).

        A refusal (no such lease, another engine still attached), or a rank that is gone or
        hangs up (it died since the manager acquired it), is ManagerError.
        """
        ranks: list[MessageStream] = []
        address = ""
        try:
            with anyio.fail_after(CONNECT_TIMEOUT_S):
                for address in sockets:
                    ms = await open_connection(address, "engine")
                    ranks.append(ms)
                    await ms.send(Attach(lease_token))
                    await ms.receive_type(Ack)
        except BaseException as exc:
            for ms in ranks:
                await anyio.aclose_forcefully(ms.stream)
            if isinstance(exc, _ATTACH_ERRORS):
                raise ManagerError(
                    f"could not attach to worker socket {address}: {_describe(exc)}"
                ) from exc
            raise
        return cls(ranks)

    def start_readers(self, tg: TaskGroup, on_lost: Callable[[int, str], None]) -> None:
        for rank, ms in enumerate(self.ranks):
            done = anyio.Event()
            self._readers_done.append(done)
            tg.start_soon(self._read, rank, ms, on_lost, done)

    async def _read(
        self,
        rank: int,
        ms: MessageStream,
        on_lost: Callable[[int, str], None],
        done: anyio.Event,
    ) -> None:
        """Read rank `rank`'s replies until its connection closes.

        Cancellation: shielded; it ends when aclose() shuts the connection, which the engine
        does before its task group exits. A read cancelled just as data arrives fails a
        callback of anyio's asyncio Unix socket ("invalid state"): an engine closed by
        cancelling its scope (the server unloading a model) hit it.
        """
        try:
            with anyio.CancelScope(shield=True):
                await self._read_until_closed(rank, ms, on_lost)
        finally:
            done.set()

    async def _read_until_closed(
        self, rank: int, ms: MessageStream, on_lost: Callable[[int, str], None]
    ) -> None:
        try:
            while True:
                msg = await ms.receive()
                if isinstance(msg, CallResult | CallFailed | StepResult):
                    self._deliver(rank, msg)
                elif isinstance(msg, ErrorReply):
                    raise ProtocolError(f"worker rank {rank} refused: {msg.message}")
        except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            if not self._closing:
                on_lost(rank, f"connection to worker rank {rank} ended ({type(exc).__name__})")
        except anyio.ClosedResourceError:
            pass  # we closed it ourselves
        except ProtocolError as exc:
            on_lost(rank, f"worker rank {rank} broke the protocol: {exc}")

    def _deliver(self, rank: int, reply: Reply) -> None:
        call = self._pending.get(reply.call_id)
        if call is None or call.replies[rank] is not None:
            return  # a call whose caller was cancelled: nobody waits for it
        call.replies[rank] = reply
        call.remaining -= 1
        if call.remaining == 0:
            call.done.set()

    def fail(self, error: EngineDeadError) -> None:
        """Mark dead and wake every pending call (they raise `error`)."""
        if self.dead is None:
            self.dead = error
            self._dead_event.set()
        for call in self._pending.values():
            call.done.set()

    async def call(
        self, make: Callable[[int], object], on_encoded: Callable[[], object] | None = None
    ) -> list[Reply]:
        """Send `make(call_id)` to every rank and return the replies in rank order."""
        return await self.collect(await self.submit(make, on_encoded))

    async def submit(
        self, make: Callable[[int], object], on_encoded: Callable[[], object] | None = None
    ) -> int:
        """Send `make(call_id)` to every rank; returns the call id for `collect`.

        The message is encoded once for all ranks; `on_encoded()` runs right after (the
        step timings' mark: from there on the engine waits on sockets and the worker).
        Every submitted call must be collected (or discarded), in any order.
        """
        if self.dead is not None:
            raise self.dead
        call_id = next(self._call_ids)
        self._pending[call_id] = _PendingCall([None] * len(self.ranks), remaining=len(self.ranks))
        try:
            frame = self.ranks[0].frame(make(call_id))
            if on_encoded is not None:
                on_encoded()
            for ms in self.ranks:
                await ms.send_frame(frame)
        except BaseException as exc:
            del self._pending[call_id]
            if isinstance(exc, anyio.BrokenResourceError | anyio.ClosedResourceError | OSError):
                raise await self._death(exc) from exc
            raise
        return call_id

    async def collect(self, call_id: int) -> list[Reply]:
        """Wait for a submitted call's replies, in rank order.

        Cancellation: the ranks still run the call; its replies are dropped on arrival.
        """
        call = self._pending[call_id]
        try:
            await call.done.wait()
        finally:
            del self._pending[call_id]
        if self.dead is not None:
            raise self.dead
        return [r for r in call.replies if r is not None]

    def discard(self, call_id: int) -> None:
        """Forget a submitted call that will not be collected: its replies are dropped."""
        self._pending.pop(call_id, None)

    async def _death(self, exc: BaseException) -> EngineDeadError:
        """A rank is gone: the engine learns why (exit code, stderr) within moments."""
        with anyio.move_on_after(DEATH_REPORT_WAIT_S):
            await self._dead_event.wait()
        return self.dead or EngineDeadError(f"worker connection broke: {exc}")

    async def aclose(self) -> None:
        """Let the readers see EOF and end, then close.

        Cancellation: shielded, bounded by a short timeout.
        """
        self._closing = True
        for ms in self.ranks:
            ms.shutdown()
        with anyio.CancelScope(shield=True), anyio.move_on_after(CONNECT_TIMEOUT_S):
            for done in self._readers_done:
                await done.wait()
        for ms in self.ranks:
            await anyio.aclose_forcefully(ms.stream)


def _describe(exc: BaseException) -> str:
    # EndOfStream and BrokenResourceError carry no message: their name says what happened.
    name, text = type(exc).__name__, str(exc)
    return f"{name}: {text}" if text else f"{name} (the worker closed the connection)"
