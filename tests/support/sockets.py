"""Raw bytes to a manager's or worker's socket, and what it answers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio

from loomllm.protocols.connection import MessageStream, client_handshake

REPLY_S = 10


async def answers_to(path: str | Path, wire: bytes, *, hello_first: bool = False) -> list[Any]:
    """Send `wire` on a fresh connection; return all the server says until it hangs up."""
    with anyio.fail_after(REPLY_S):
        async with await anyio.connect_unix(os.fspath(path)) as stream:
            ms = MessageStream(stream)
            if hello_first:
                await client_handshake(ms, "test")
            await stream.send(wire)
            await stream.send_eof()  # a truncated frame stays truncated
            answers = []
            while True:
                try:
                    answers.append(await ms.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return answers
