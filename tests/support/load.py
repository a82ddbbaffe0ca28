"""Load against a real loom serve: request specs, answer checks and client lanes."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

NAME = "tiny"


RSS_SLACK_MIB = 8  # allocator arenas and caches settle in steps this size


@dataclass(frozen=True, slots=True)
class Spec:
    chat: bool
    stream: bool
    words: int
    max_tokens: int
    n: int

    def body(self, i: int) -> dict[str, Any]:
        text = " ".join(f"w{(i + k) % 200 + 20}" for k in range(self.words))
        body: dict[str, Any] = {
            "model": NAME,
            "max_tokens": self.max_tokens,
            "n": self.n,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            return {**body, "messages": [{"role": "user", "content": text}]}
        return {**body, "prompt": text}

    @property
    def prompt_tokens(self) -> int:
        return self.words + 2 if self.chat else self.words  # the template adds two words


def check_whole(spec: Spec, body: dict[str, Any]) -> str:
    """The checked body's id."""
    assert body["object"] == ("chat.completion" if spec.chat else "text_completion"), body
    choices = body["choices"]
    assert sorted(c["index"] for c in choices) == list(range(spec.n)), body
    assert all(c["finish_reason"] == "length" for c in choices), body
    for c in choices:
        text = c["message"]["content"] if spec.chat else c["text"]
        assert len(text.split()) == spec.max_tokens, body  # one word per token, none special
    assert body["usage"] == {
        "prompt_tokens": spec.prompt_tokens,
        "completion_tokens": spec.max_tokens * spec.n,
        "total_tokens": spec.prompt_tokens + spec.max_tokens * spec.n,
    }
    return body["id"]


def check_stream(spec: Spec, raw: str) -> str:
    """The checked stream's id: `data:` events, [DONE] once and last, usage just before it."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), raw[-400:]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, raw[-400:]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    *deltas, last = chunks
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == spec.max_tokens * (spec.n)
        and last["usage"]["prompt_tokens"] == spec.prompt_tokens
    ), last
    assert len({c["id"] for c in chunks}) == 1
    kind = "chat.completion.chunk" if spec.chat else "text_completion"
    assert all(c["object"] == kind for c in chunks)
    texts: dict[int, str] = {i: "" for i in range(spec.n)}
    finish: dict[int, str] = {}
    for c in deltas:
        (choice,) = c["choices"]
        assert choice["index"] not in finish, "nothing after a choice's finish_reason"
        texts[choice["index"]] += (
            (choice["delta"].get("content") or "") if spec.chat else (choice["text"])
        )
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert finish == {i: "length" for i in range(spec.n)}, finish
    assert all(len(t.split()) == spec.max_tokens for t in texts.values()), texts
    return chunks[0]["id"]


@asynccontextmanager
async def lane_clients(
    base_url: str, num: int, request_s: float
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """`num` clients of one connection each: httpx's pool slows down past a few dozen
    connections (the test client, not the server, would set the pace). They drop a
    connection idle for 2 s, before the server's 5 s keep-alive timeout can close it under
    a request being sent.
    """
    tls = ssl.create_default_context()  # never used (http://), but costly to make per client
    limits = httpx.Limits(max_connections=1, keepalive_expiry=2)
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=base_url, limits=limits, timeout=request_s, verify=tls)
            )
            for _ in range(num)
        ]


def mib(n: int) -> float:
    return round(n / 2**20, 1)
