"""End to end: a real `loom serve` subprocess (asyncio and trio) driven by the official `openai`
client, sync and async. Completions and chat, streaming or not, n=2, stop strings, logprobs,
usage equal to the token counts; then 200 concurrent streams and the server's RSS.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from support.servers import LoomServer, loom_serve, rss_bytes

NAME = "tiny"
PROMPT = "w5 w6 w7"
MESSAGES = [
    {"role": "user", "content": "w5 w6"},
    {"role": "assistant", "content": "w7"},
    {"role": "user", "content": "w8"},
]
# The tiny tokenizer has no special tokens: with the eos word ignored, every sampled word,
# "w2" included, is in the text (an eos that ends a request is not).
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def loom_server(request, chat_model, shared_manager) -> Iterator[LoomServer]:
    """`loom serve --loop <param>` for this module; SIGTERM at the end must exit with 0."""
    with loom_serve(chat_model, shared_manager.socket, NAME, loop=request.param) as running:
        yield running


@pytest.fixture
def client(loom_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=loom_server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def num_prompt_tokens(loom_server: LoomServer, **body: Any) -> int:
    """The server's own /tokenize count for a prompt or messages."""
    response = httpx.post(loom_server.base_url + "/tokenize", json={"model": NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def greedy_text(client: openai.OpenAI, max_tokens: int = 8) -> str:
    done = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS
    )
    return done.choices[0].text


def stop_word(text: str) -> str:
    """A word of `text` past its first, so a stop on it leaves some text before it."""
    words = text.split()
    assert len(words) >= 3, text
    return words[2]


def test_completions_n2_logprobs_usage(loom_server, client):
    done = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=5, n=2, logprobs=2, extra_body=IGNORE_EOS
    )
    assert [c.index for c in done.choices] == [0, 1]
    for choice in done.choices:
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(token in choice.text for token in lp.tokens)
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # top 2 (+ the sampled one)
    assert done.usage.prompt_tokens == num_prompt_tokens(loom_server, prompt=PROMPT)
    assert (
        done.usage.completion_tokens == 2 * 5 == sum(len(c.logprobs.tokens) for c in done.choices)
    )
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_completions_without_ignore_eos_count_generated_tokens(loom_server, client):
    done = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, n=2, logprobs=0)
    assert done.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in done.choices)


def test_completions_stop_string(loom_server, client):
    full = greedy_text(client)
    word = stop_word(full)
    done = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stop=[word, "never-seen"],
        logprobs=0,
        extra_body=IGNORE_EOS,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(word)]
    assert word not in choice.text
    # The token that completed the stop string was generated and is counted.
    tokens = choice.logprobs.tokens
    assert tokens[-1].startswith(word) and not any(t.startswith(word) for t in tokens[:-1])
    assert done.usage.completion_tokens == len(tokens)


def test_completions_stream_matches_non_stream(loom_server, client):
    full = greedy_text(client, max_tokens=6)
    stream = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
            continue
        assert usage is None, "the usage chunk comes last"
        (choice,) = chunk.choices
        assert choice.index not in finish, "nothing after a choice's finish_reason"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert texts == {0: full, 1: full}
    assert finish == {0: "length", 1: "length"}
    assert usage.prompt_tokens == num_prompt_tokens(loom_server, prompt=PROMPT)
    assert usage.completion_tokens == 6 * 2


def test_chat_n2_logprobs_usage(loom_server, client):
    done = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    assert done.object == "chat.completion"
    assert [c.index for c in done.choices] == [0, 1]
    for choice in done.choices:
        assert choice.finish_reason == "length"
        assert choice.message.role == "assistant"
        content = choice.logprobs.content
        assert len(content) == 4
        assert " ".join(t.token for t in content) == choice.message.content.strip()
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert all(t.bytes == list(t.token.encode()) for t in content)
    assert done.usage.prompt_tokens == num_prompt_tokens(loom_server, messages=MESSAGES)
    assert (
        done.usage.completion_tokens == 4 * 2 == sum(len(c.logprobs.content) for c in done.choices)
    )


def test_chat_stream_stop_string(loom_server, client):
    full = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    text = full.choices[0].message.content
    word = stop_word(text)
    stream = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stop=word,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    tokens = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert content == text[: text.index(word)]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.prompt_tokens == num_prompt_tokens(loom_server, messages=MESSAGES)
    assert tokens[-1].startswith(word) and not any(t.startswith(word) for t in tokens[:-1])
    assert chunks[-1].usage.completion_tokens == len(tokens)


# The openai client leaves its chain of body generators unclosed once it has read [DONE] (it
# breaks out of its `async for`): trio's finalizer warns about each, asyncio's closes them.
@pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage:ResourceWarning"
)
@pytest.mark.anyio
async def test_async_client_chat_stream_and_completions(loom_server, anyio_backend):
    base = loom_server.base_url + "/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as aclient:
        stream = await aclient.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=5,
            n=2,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        roles: dict[int, str] = {}
        tokens: dict[int, int] = defaultdict(int)
        finish: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            (choice,) = chunk.choices
            if choice.delta.role is not None:
                roles[choice.index] = choice.delta.role
            if choice.logprobs is not None:
                tokens[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        assert roles == {0: "assistant", 1: "assistant"}
        assert tokens == {0: 5, 1: 5} and finish == {0: "length", 1: "length"}
        assert usage.completion_tokens == 10
        async with httpx.AsyncClient(base_url=loom_server.base_url) as http:
            tokenized = await http.post("/tokenize", json={"messages": MESSAGES})
            assert usage.prompt_tokens == tokenized.json()["count"]
            counts = [
                (await http.post("/tokenize", json={"prompt": p})).json()["count"]
                for p in (PROMPT, "w9")
            ]

        done = await aclient.completions.create(
            model=NAME, prompt=[PROMPT, "w9"], max_tokens=3, n=2, extra_body=IGNORE_EOS
        )
        assert [c.index for c in done.choices] == [0, 1, 2, 3]
        assert done.usage.completion_tokens == 3 * 2 * 2
        assert done.usage.prompt_tokens == sum(counts)


# 200 concurrent streams ---------------------------------------------------------------------

NUM_STREAMS = 200


def check_raw_sse(body: str) -> None:
    """One chat stream, raw: `data: ` events ended by blank lines, role first, [DONE] last."""
    assert body.endswith("\n\n"), body[-200:]
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, body[-200:]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"]["role"] == "assistant"
    assert "".join(c["delta"].get("content") or "" for c in choices).split()
    assert choices[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])


async def one_round(aclient: openai.AsyncOpenAI, num: int) -> None:
    """`num` concurrent streaming chats through one client; each stream checked raw."""
    failures: list[BaseException] = []

    async def one(i: int) -> None:
        messages = [{"role": "user", "content": f"w{i % 200 + 20} w{i % 7 + 3}"}]
        try:
            async with aclient.chat.completions.with_streaming_response.create(
                model=NAME, messages=messages, max_tokens=8, stream=True, extra_body=IGNORE_EOS
            ) as response:
                assert response.status_code == 200
                check_raw_sse("".join([text async for text in response.iter_text()]))
        except Exception as exc:  # collected: one failure should not hide the rest
            failures.append(exc)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(num):
                tg.start_soon(one, i)
    assert not failures, f"{len(failures)} of {num} streams failed, first: {failures[0]!r}"


@pytest.mark.parametrize("loom_server", ["asyncio"], indirect=True)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_200_concurrent_streams_and_flat_rss(loom_server, anyio_backend):
    base = loom_server.base_url + "/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=60) as aclient:
        await one_round(aclient, 20)  # warm-up: allocator arenas, connection pool, caches
        await one_round(aclient, NUM_STREAMS)
        first = rss_bytes(loom_server.pid)
        await one_round(aclient, NUM_STREAMS)
        second = rss_bytes(loom_server.pid)
    assert second <= first * 1.10 + 8 * 2**20, (first, second)
