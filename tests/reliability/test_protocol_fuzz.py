"""Generated bad input at the real sockets: the manager's and a worker's refuse every case
and keep serving their legitimate peers.

Hypothesis (derandomized: CI replays the same cases) builds each connection's bytes from
raw garbage, framed msgpack, `[type_code, fields]` bodies, valid messages in the wrong
place, oversized length prefixes and frames cut short, sent with or without a HELLO
first; then the client half-closes (and reads every answer) or just hangs up. Each
connection must end within REPLY_S with an ErrorReply naming the refusal; the daemon and
the worker must still answer their own peers every CHECK_EVERY cases and at the end.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import cloudpickle
import msgpack
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.processes import is_alive

from loomllm import LLM
from loomllm.protocols.codec import decode, encode, registered_messages
from loomllm.protocols.errors import ProtocolError
from loomllm.protocols.framing import DEFAULT_MAX_FRAME_SIZE, HEADER, FrameReader
from loomllm.protocols.messages import (
    PROTOCOL_VERSION,
    Ack,
    AcquireWorkers,
    Attach,
    CallResult,
    ErrorReply,
    Hello,
    Lease,
    ListWorkers,
    ManagerStatus,
    ReleaseWorkers,
    RunCallable,
    ShutdownManager,
    StatusRequest,
    UnloadModel,
    Welcome,
    WorkerList,
)
from loomllm.protocols.sampling import SamplingParams

MANAGER_CASES = 1200
WORKER_CASES = 1000
CHECK_EVERY = 250  # cases between two checks that the legitimate peer is still served
REPLY_S = 10.0  # each connection ends within this
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
# Requests the manager would carry out (ShutdownManager would stop the shared daemon):
# the fuzzer sends everything but these.
MANAGER_REQUESTS = (
    AcquireWorkers,
    ReleaseWorkers,
    StatusRequest,
    ListWorkers,
    UnloadModel,
    ShutdownManager,
)
REQUEST_CODES = {c for c, cls in registered_messages().items() if cls in MANAGER_REQUESTS}
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


# -- what goes on the wire --------------------------------------------------------------


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


# Two levels deep at most: hypothesis draws deeply recursive values several times slower,
# and a field's checks fail on its own type before they look inside it.
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
MSGPACK_VALUES = (
    LEAVES | st.lists(LEAVES, max_size=4) | st.dictionaries(st.text(max_size=6), LEAVES, max_size=3)
)
INTS = st.integers(-(2**31), 2**31)
# Registered type codes and unknown ones, none of them a manager request's.
TYPE_CODES = (
    st.sampled_from(sorted(registered_messages().keys() - REQUEST_CODES))
    | st.integers(-300, min(REQUEST_CODES) - 1)
    | st.integers(max(REQUEST_CODES) + 1, 2**16)
)


def wrong_messages(touch_payload: bytes) -> st.SearchStrategy[Any]:
    """Valid messages that a server takes nowhere in a fuzzed connection (but a HELLO
    that opens one, and an Attach, refused for its token)."""
    return st.one_of(
        st.builds(Ack),
        st.builds(Welcome, INTS, st.text(max_size=10), INTS),
        st.builds(ErrorReply, st.text(max_size=10), st.text(max_size=20)),
        st.builds(Hello, st.just(PROTOCOL_VERSION) | INTS, st.text(max_size=10), INTS),
        st.builds(Lease, st.binary(max_size=40)),
        st.builds(Attach, st.binary(max_size=40)),
        st.builds(CallResult, INTS, st.binary(max_size=20)),
        st.builds(RunCallable, INTS, st.just(touch_payload)),  # must never run
    )


def connections(touch_payload: bytes) -> st.SearchStrategy[tuple[bool, bytes, str]]:
    """(say HELLO first?, the bytes, then "eof" (half-close, read) or "close" (hang up))."""
    framed = st.one_of(
        MSGPACK_VALUES.map(lambda v: frame(msgpack.packb(v))),
        st.tuples(TYPE_CODES, st.lists(MSGPACK_VALUES, max_size=6)).map(
            lambda cf: frame(msgpack.packb(list(cf)))
        ),
        wrong_messages(touch_payload).map(lambda m: frame(encode(m))),
    )
    oversized = st.tuples(
        st.integers(DEFAULT_MAX_FRAME_SIZE + 1, 2**32 - 1), st.binary(max_size=16)
    ).map(lambda t: HEADER.pack(t[0]) + t[1])
    pieces = st.lists(st.binary(min_size=1, max_size=48) | framed | oversized, max_size=3)

    @st.composite
    def connection(draw: st.DrawFn) -> tuple[bool, bytes, str]:
        hello_first = draw(st.booleans())
        wire = b"".join(draw(pieces))
        if hello_first and draw(st.booleans()):  # what an engine says next, with a guess
            wire = frame(encode(Attach(draw(st.binary(max_size=40))))) + wire
        if wire and draw(st.booleans()):  # close mid-frame (or mid-header)
            wire = wire[: draw(st.integers(0, len(wire) - 1))]
        return hello_first, wire, draw(st.sampled_from(["eof", "eof", "close"]))

    return connection()


def is_broken(wire: bytes) -> bool:
    """Does `wire` break the framing or the codec somewhere (as the server reads it)?"""
    reader = FrameReader()
    try:
        for body in reader.feed(wire):
            decode(body)
        reader.close()
    except ProtocolError:
        return True
    return False


def carries_request(wire: bytes) -> bool:
    """Does a manager request decode from `wire` (a random body can be `[20, []]`)?"""
    reader = FrameReader()
    try:
        return any(isinstance(decode(b), MANAGER_REQUESTS) for b in reader.feed(wire))
    except ProtocolError:
        return False  # only frames before the first bad one are read; a loose guard is fine


# -- a blocking client ------------------------------------------------------------------


def connect(path: str | Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REPLY_S)
    try:
        sock.connect(os.fspath(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise AssertionError(f"nobody serves {path} any more: {exc!r}") from exc
    return sock


def read_frames(sock: socket.socket, reader: FrameReader, want: int | None) -> list[Any]:
    """Messages until `want` of them arrived (None: until the peer hangs up)."""
    messages: list[Any] = []
    while want is None or len(messages) < want:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:  # it hung up on bytes it did not read: still an end
            data = b""
        if not data:
            reader.close()  # a server never leaves half a frame behind
            assert want is None, f"hung up after {messages}, before {want} messages"
            break
        messages += [decode(body) for body in reader.feed(data)]
    return messages


def say_hello(sock: socket.socket, reader: FrameReader) -> None:
    sock.sendall(frame(encode(Hello(PROTOCOL_VERSION, "fuzz", os.getpid()))))
    [welcome] = read_frames(sock, reader, 1)
    assert isinstance(welcome, Welcome), welcome


def exchange(path: str | Path, hello_first: bool, wire: bytes, end: str) -> list[Any] | None:
    """One fuzzed connection; every answer until the server hangs up (None: we hung up)."""
    with connect(path) as sock:
        reader = FrameReader()
        if hello_first:
            say_hello(sock, reader)
        try:
            sock.sendall(wire)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it refused an early part already; its answer is still there to read
        if end == "close":
            return None
        sock.shutdown(socket.SHUT_WR)  # a frame cut short stays cut short
        return read_frames(sock, reader, None)


def request(path: str | Path, msg: Any) -> Any:
    """A legitimate client's request and its reply."""
    with connect(path) as sock:
        reader = FrameReader()
        say_hello(sock, reader)
        sock.sendall(frame(encode(msg)))
        return read_frames(sock, reader, 1)[0]


# -- the oracle -------------------------------------------------------------------------


@dataclass
class Tally:
    server: str
    refusals: set[str]  # the ErrorReply kinds this server may answer a fuzzed connection with
    run: int = 0
    refused_as_broken: int = 0  # connections whose bytes broke framing or codec: refused
    worst_s: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)  # the ErrorReply kinds answered

    def check(self, hello_first: bool, wire: bytes, answers: list[Any] | None) -> None:
        self.run += 1
        if answers is None:
            return  # we hung up first: only the server's survival is checked
        assert all(isinstance(a, ErrorReply | Welcome) for a in answers), answers
        refusals = [a for a in answers if isinstance(a, ErrorReply)]
        assert {a.kind for a in refusals} <= self.refusals, refusals
        self.kinds.update(a.kind for a in refusals)
        if not wire:
            assert answers == [], answers
            return
        assert answers, f"{self.server} hung up without a word"
        if is_broken(wire):
            # The first bad frame ends it, unless something before it ended it already.
            last = answers[-1]
            assert isinstance(last, ErrorReply), answers
            assert last.kind in self.refusals - {"bad_request"}, answers
            self.refused_as_broken += 1

    def timed(self, path: str | Path, hello_first: bool, wire: bytes, end: str) -> None:
        start = time.monotonic()
        answers = exchange(path, hello_first, wire, end)
        self.worst_s = max(self.worst_s, time.monotonic() - start)
        self.check(hello_first, wire, answers)

    def run_all(self, fuzz: Callable[[], None], report: Any) -> None:
        """Run the hypothesis search, then record the figures, failed or not."""
        failed = True
        try:
            fuzz()
            failed = False
        finally:
            report.record(
                f"protocol fuzz: {self.server} socket, cases",
                self.run - failed,
                self.run,
                self.worst_s,
            )
            print(self)  # the figures, for `pytest -s`


def touch_payload(path: Path) -> bytes:
    """collective_rpc's payload for a call that creates `path`: proof if it ever ran."""
    return cloudpickle.dumps((lambda worker: path.touch(), (), {}))


# -- the manager ------------------------------------------------------------------------


def manager_status(socket_path: Path) -> ManagerStatus:
    reply = request(socket_path, StatusRequest())
    assert isinstance(reply, ManagerStatus), reply
    return reply


def test_manager_refuses_fuzzed_connections(shared_manager, fault_report, tmp_path) -> None:
    path = shared_manager.socket
    pid = manager_status(path).pid
    tally = Tally("engine-manager", {"protocol_error", "version_mismatch", "bad_request"})

    @settings(max_examples=MANAGER_CASES, **FUZZ)
    @given(case=connections(touch_payload(tmp_path / "ran")))
    def fuzz(case: tuple[bool, bytes, str]) -> None:
        hello_first, wire, end = case
        assume(not carries_request(wire))
        tally.timed(path, hello_first, wire, end)
        if tally.run % CHECK_EVERY == 0:
            assert manager_status(path).pid == pid

    tally.run_all(fuzz, fault_report)
    assert tally.run >= MANAGER_CASES, tally
    assert tally.refused_as_broken > tally.run // 4, tally  # the generator does break things
    assert is_alive(pid) and manager_status(path).pid == pid
    status = shared_manager.cli("status")  # the real CLI, a client of its own
    assert status.returncode == 0 and f"pid {pid}," in status.stdout, status
    assert isinstance(request(path, ListWorkers()), WorkerList)
    assert not (tmp_path / "ran").exists()


# -- a worker's data socket -------------------------------------------------------------


def test_worker_refuses_fuzzed_connections(
    shared_manager, tiny_model, fault_report, tmp_path
) -> None:
    ran = tmp_path / "ran"
    open_llm = partial(LLM, tiny_model, manager_socket=shared_manager.socket, dtype="float32")
    tally = Tally("worker", {"protocol_error", "version_mismatch", "lease_refused"})
    with open_llm() as llm:
        # The engine holds the worker's lease all along: fuzzed connections never wait for
        # it to leave, and must not disturb it.
        path, [pid] = llm.engine._replicas[0].acquired.sockets[0], llm.engine.worker_pids
        expected = llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)

        def served() -> bool:
            again = llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)
            return again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids

        @settings(max_examples=WORKER_CASES, **FUZZ)
        @given(case=connections(touch_payload(ran)))
        def fuzz(case: tuple[bool, bytes, str]) -> None:
            tally.timed(path, *case)
            if tally.run % CHECK_EVERY == 0:
                assert served()

        tally.run_all(fuzz, fault_report)
        assert tally.run >= WORKER_CASES, tally
        assert tally.refused_as_broken > tally.run // 4, tally
        assert served() and is_alive(pid)
    # A new engine attaches to the same warm worker and generates.
    with open_llm() as llm:
        assert llm.engine.worker_pids == [pid] and llm.engine.reused_warm_workers
        [out] = llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert not ran.exists()  # no fuzzed RunCallable ever ran
