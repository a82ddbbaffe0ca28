"""What sending one step to N tensor-parallel ranks costs the engine: bytes, encode and writes.

Decode and prompt steps written to 1, 2 and 4 Unix sockets. Run: `loom bench engine broadcast`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import anyio
from anyio.abc import UNIXSocketStream

from loomllm.benchmarks import int_list
from loomllm.protocols.connection import MessageStream
from loomllm.protocols.messages import CachedRequests, ExecuteStep, NewRequestData, SchedulerOutput
from loomllm.protocols.sampling import SamplingParams

PROG = "loom bench engine broadcast"


def decode_step(batch: int) -> SchedulerOutput:
    ids = [f"req-{i}" for i in range(batch)]
    cached = CachedRequests(ids, [[] for _ in ids], [150 + i for i in range(batch)])
    return SchedulerOutput(7, [], cached, {r: 1 for r in ids}, [])


def prefill_step(batch: int, prompt_len: int) -> SchedulerOutput:
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=1)
    new = [
        NewRequestData(
            f"req-{i}",
            list(range(1000, 1000 + prompt_len)),
            [],
            params,
            [2],
            list(range(i * 8, i * 8 + 8)),
            0,
        )
        for i in range(batch)
    ]
    return SchedulerOutput(
        3, new, CachedRequests([], [], []), {n.req_id: prompt_len for n in new}, []
    )


async def measure(step: SchedulerOutput, ranks: int, repeats: int) -> tuple[int, float, float]:
    """(frame bytes, median µs to encode, median µs to write the frame to `ranks` sockets)."""
    pairs = [socket.socketpair() for _ in range(ranks)]
    encode_us, send_us = [], []
    drains = [threading.Thread(target=_drain, args=(theirs,)) for _, theirs in pairs]
    for thread in drains:
        thread.start()
    try:
        streams = [MessageStream(await UNIXSocketStream.from_socket(ours)) for ours, _ in pairs]
        for i in range(repeats):
            start = time.perf_counter()
            frame = streams[0].frame(ExecuteStep(i, step))
            encoded = time.perf_counter()
            for ms in streams:
                await ms.send_frame(frame)
            sent = time.perf_counter()
            encode_us.append((encoded - start) * 1e6)
            send_us.append((sent - encoded) * 1e6)
        for ms in streams:
            await ms.stream.aclose()
    finally:
        for thread in drains:
            thread.join()
    return len(frame), statistics.median(encode_us), statistics.median(send_us)


def _drain(sock: socket.socket) -> None:
    """A worker's side: take the bytes off the socket until the engine closes it."""
    with sock:
        while sock.recv(1 << 20):
            pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--ranks", type=int_list, default=[1, 2, 4])
    args = p.parse_args(argv)
    print(
        "| step | frame bytes | encode µs | "
        + " | ".join(f"send to {n} µs" for n in args.ranks)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.ranks))
    steps = [(f"decode, batch {b}", decode_step(b)) for b in args.batch_sizes] + [
        (f"prefill, {b} x {args.prompt_len} tokens", prefill_step(b, args.prompt_len))
        for b in args.batch_sizes
    ]
    for name, step in steps:
        cells, size, encode = [], 0, 0.0
        for ranks in args.ranks:
            size, encode, send = anyio.run(measure, step, ranks, args.repeats)
            cells.append(f"{send:.1f}")
        print(f"| {name} | {size} | {encode:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
