"""The OpenAI-compatible server, for real: hypercorn on 127.0.0.1 (port 0) over a tiny model's
Engine, driven with httpx. Bodies, streaming, errors, API key, disconnect. asyncio and trio.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import pytest
from support.servers import NAME, assert_error, free_port, running, sse_events

from loomllm import Engine

pytestmark = pytest.mark.anyio


async def test_models_health_version(server):
    _, client = server
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == NAME
    health = await client.get("/health")
    assert health.status_code == 200
    assert "version" in (await client.get("/version")).json()


async def test_completion_streaming_matches_non_streaming(server):
    engine, client = server
    body = {
        "model": NAME,
        "prompt": "w5 w17 w42",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = (await client.post("/v1/completions", json=body)).json()
    assert whole["object"] == "text_completion" and whole["model"] == NAME
    choice = whole["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=stream_body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)
    # vLLM's continuous_usage_stats: every chunk counts the tokens so far.
    continuous = {
        **stream_body,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with client.stream("POST", "/v1/completions", json=continuous) as response:
        events = await sse_events(response)
    seen = {0: 0, 1: 0}
    for event in events[:-2]:
        (c,) = event["choices"]
        seen[c["index"]] += 1
        assert event["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": seen[c["index"]],
            "total_tokens": 3 + seen[c["index"]],
        }
    assert seen == {0: 8, 1: 8} and events[-2]["usage"]["completion_tokens"] == 16
    tokens = await client.post("/tokenize", json={"prompt": "w5 w17 w42"})
    assert tokens.json()["tokens"] == [5, 17, 42]
    text = await client.post("/detokenize", json={"tokens": [5, 17]})
    assert text.json()["prompt"] == "w5 w17"


async def test_completion_n_lists_logprobs_echo(server):
    _, client = server
    body = {
        "prompt": [[5, 6, 7], [8, 9]],
        "n": 2,
        "max_tokens": 3,
        "seed": 1,
        "ignore_eos": True,
        "logprobs": 2,
    }
    out = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 12
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) == 2
    # vLLM's return_tokens_as_token_ids: the same logprobs, each token as its id (the tiny
    # vocabulary's token i is the word w<i>).
    as_ids = (
        await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
    ).json()["choices"][0]["logprobs"]
    assert as_ids["tokens"] == [f"token_id:{t[1:]}" for t in lp["tokens"]]
    assert as_ids["token_logprobs"] == lp["token_logprobs"]
    assert [list(top) for top in as_ids["top_logprobs"]] == [
        [f"token_id:{t[1:]}" for t in top] for top in lp["top_logprobs"]
    ]
    echoed = (
        await client.post(
            "/v1/completions",
            json={"prompt": "w5 w6", "echo": True, "max_tokens": 2, "temperature": 0},
        )
    ).json()
    assert echoed["choices"][0]["text"].startswith("w5 w6")


async def test_logit_bias_and_allowed_token_ids_steer_the_tokens(server):
    _, client = server
    body = {"prompt": "w5 w6", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    forced = await client.post("/v1/completions", json={**body, "logit_bias": {"9": 100}})
    assert forced.json()["choices"][0]["text"].split() == ["w9"] * 4 != plain.split()
    sampled = {**body, "temperature": 1.0, "max_tokens": 8, "allowed_token_ids": [7, 8]}
    answer = await client.post("/v1/completions", json=sampled)
    assert set(answer.json()["choices"][0]["text"].split()) <= {"w7", "w8"}
    first = plain.split()[0]
    banned = await client.post("/v1/completions", json={**body, "bad_words": [first]})
    assert first not in banned.json()["choices"][0]["text"].split()
    for words in (["ok", "  "], "w5", [5], ["w5"] * 1001, ["w5 " * 67]):
        response = await client.post("/v1/completions", json={**body, "bad_words": words})
        assert_error(response, 400, "bad_words")
    cut = await client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 1})
    assert cut.json()["usage"]["prompt_tokens"] == 1
    for value in (0, -2, "1"):
        response = await client.post(
            "/v1/completions", json={**body, "truncate_prompt_tokens": value}
        )
        assert_error(response, 400, "truncate_prompt_tokens")
    unknown = await client.post("/v1/completions", json={**body, "bad_words": ["w9999999"]})
    assert unknown.status_code == 200  # not a word of this vocabulary: <unk>, banned alone


async def test_structured_outputs_and_a_grammar_that_does_not_compile(server):
    engine, client = server
    body = {"prompt": "w5 w6", "max_tokens": 4, "temperature": 1.0, "seed": 5, "n": 4}
    # The tiny tokenizer's tokens are words, which a grammar reads concatenated. (No choice
    # with a dead end, as "w9w11": after w9, w1 continues it too, and no token is "1".)
    for fields in (
        {"structured_outputs": {"choice": ["w7", "w9w8"]}},
        {"guided_choice": ["w7", "w9w8"]},
        {"guided_regex": "(w7|w9w8)"},
    ):
        out = (await client.post("/v1/completions", json={**body, **fields})).json()
        assert {c["text"].replace(" ", "") for c in out["choices"]} <= {"w7", "w9w8"}, out
    error = assert_error(
        await client.post("/v1/completions", json={**body, "guided_json": "x"}), 400, "guided_json"
    )
    assert error["message"].startswith("guided_json is not JSON")
    # Any JSON value: the tiny vocabulary ("w0" to "w255") cannot spell one.
    error = assert_error(
        await client.post("/v1/completions", json={**body, "guided_json": True}), 400, "guided_json"
    )
    assert error["message"] == (
        "guided_json: no token of this model's vocabulary can continue the grammar"
    )
    bad = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "frob"}},
        }
    }
    error = assert_error(
        await client.post("/v1/completions", json={**body, **bad}), 400, "response_format"
    )
    assert "does not compile" in error["message"] and "frob" in error["message"]
    # Streamed too: a 400 before the stream starts (its first output is awaited), as vLLM.
    streamed = await client.post("/v1/completions", json={**body, **bad, "stream": True})
    assert_error(streamed, 400, "response_format")
    await engine.wait_until_idle()
    assert engine.stats().num_running == 0


async def test_bad_input_is_400_naming_the_field(server):
    engine, client = server
    cases = [
        ({"prompt": "w5", "temperature": -1}, "temperature"),
        ({"prompt": "w5", "top_p": 0}, "top_p"),
        ({"prompt": "w5", "n": 0}, "n"),
        ({"prompt": "w5", "max_tokens": "x"}, "max_tokens"),
        ({"prompt": "w5", "stop": [1]}, "stop"),
        ({"prompt": "w5", "seed": 2**100}, "seed"),  # would not fit the wire to the worker
        ({"prompt": "w5", "n": 1000}, "n"),
        ({"prompt": "w5", "logprobs": 21}, "logprobs"),
        ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "w5", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [99999]}, "prompt"),
        ({"prompt": " ".join(["w5"] * 600)}, "prompt"),
        ({"prompt": "w5", "seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1's seed + 1
        ({"prompt": "w5", "min_tokens": 2, "stop_token_ids": [100000]}, "stop_token_ids"),
        ({"prompt": "w5", "logit_bias": {"5": 101}}, "logit_bias"),  # OpenAI's [-100, 100]
        ({"prompt": "w5", "logit_bias": {"05": 1}}, "logit_bias"),
        ({"prompt": "w5", "logit_bias": {"w5": 1}}, "logit_bias"),
        ({"prompt": "w5", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": "w5", "logit_bias": {"100000": 1}}, "logit_bias"),
        ({"prompt": "w5", "logit_bias": {"9" * 40: 1}}, "logit_bias"),
        ({"prompt": "w5", "logit_bias": [5]}, "logit_bias"),
        ({"prompt": "w5", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "w5", "allowed_token_ids": [100000]}, "allowed_token_ids"),
        ({"prompt": "w5", "allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids"),
        # Not implemented: a 400, not an answer that ignores them.
        ({"prompt": "w5", "response_format": {"type": "xml"}}, "response_format"),
        (
            {"prompt": "w5", "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        (
            {"prompt": "w5", "response_format": {"type": "json_object"}, "guided_regex": "w5"},
            "guided_regex",
        ),
        ({"prompt": "w5", "structured_outputs": {}}, "structured_outputs"),
        (
            {"prompt": "w5", "structured_outputs": {"regex": "w5", "choice": ["w6"]}},
            "structured_outputs",
        ),
        ({"prompt": "w5", "structured_outputs": {"xml": "w5"}}, "structured_outputs"),
        ({"prompt": "w5", "guided_choice": []}, "guided_choice"),
        ({"prompt": "w5", "guided_json": "{oops"}, "guided_json"),
        (
            {"prompt": "w5", "structured_outputs": {"regex": "w5", "json_object": False}},
            "structured_outputs",
        ),
        ({"prompt": "w5", "structured_outputs": {"json_object": False}}, "structured_outputs"),
        (
            {
                "prompt": "w5",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": 5, "schema": {}},
                },
            },
            "response_format",
        ),
        (
            {
                "prompt": "w5",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"strict": 1, "schema": {}},
                },
            },
            "response_format",
        ),
        ({"prompt": "w5", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"prompt": "w5", "tool_choice": "auto"}, "tool_choice"),
    ]
    for body, param in cases:
        assert_error(await client.post("/v1/completions", json=body), 400, param)
    # The same fields with values that ask for nothing, as SDKs may send them: answered.
    no_ops = {
        "logit_bias": {},
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "max_tokens": 2,
    }
    assert (await client.post("/v1/completions", json={"prompt": "w5", **no_ops})).json()["usage"][
        "completion_tokens"
    ] <= 2
    # null is absent, here as everywhere: no usage chunk.
    body = {
        "prompt": "w5",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": None},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = await sse_events(response)
    assert events[-1] == "[DONE]" and all(
        "usage" not in e or e["usage"] is None for e in events[:-1]
    )
    assert_error(
        await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "w5"}), 404, "model"
    )
    assert_error(await client.post("/v1/completions", content=b"{not json"), 400, None)
    assert_error(await client.post("/v1/completions", json=[1, 2]), 400, None)
    assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert (await client.get("/v1/nothing")).status_code == 404
    # No template on this model: a clear 400, not a 500.
    chat = {"messages": [{"role": "user", "content": "w5"}]}
    error = assert_error(await client.post("/v1/chat/completions", json=chat), 400, "messages")
    assert "chat template" in error["message"]
    assert_error(await client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    await engine.wait_until_idle()
    assert engine.stats().num_running == 0


async def test_oversized_and_undecodable_bodies_are_4xx(tiny_model, shared_manager):
    async with running(tiny_model, shared_manager, max_body_bytes=1 << 20) as (engine, client):
        ten_mb = b'{"model": "tiny", "prompt": "' + b"w5 " * 3_500_000 + b'"}'
        error = assert_error(await client.post("/v1/completions", content=ten_mb), 413, None)
        assert error["code"] == "request_too_large"

        async def chunked():  # no content-length: the limit counts what arrives
            for _ in range(40):
                yield b" " * 65536

        assert_error(await client.post("/v1/chat/completions", content=chunked()), 413, None)
        bad_utf8 = b'{"model": "tiny", "prompt": "w5 \xff\xfe"}'
        assert_error(await client.post("/v1/completions", content=bad_utf8), 400, None)
        ok = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


async def test_chat_happy_path_and_stream(chat_model, shared_manager):
    async with running(chat_model, shared_manager) as (_, client):
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": "w5 w6"}],
            "max_completion_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        assert whole["object"] == "chat.completion"
        message = whole["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"]
        assert whole["usage"]["completion_tokens"] == 5
        content_lps = whole["choices"][0]["logprobs"]["content"]
        assert len(content_lps) == 5 and len(content_lps[0]["top_logprobs"]) == 2
        assert_error(
            await client.post("/v1/chat/completions", json={**body, "top_logprobs": 99}),
            400,
            "top_logprobs",
        )
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
            events = await sse_events(response)
        assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
        assert text == message["content"]
        assert events[-3]["choices"][0]["finish_reason"] == "length"


async def test_prompt_and_max_tokens_past_the_context_are_400_naming_both(
    chat_model, shared_manager
):
    """As vLLM and the OpenAI API answer; without max_tokens a request gets the rest of the
    context; a refused request costs the others nothing."""
    async with running(chat_model, shared_manager, {"max_model_len": 64}) as (engine, client):
        prompt = " ".join(["w5"] * 20)
        fits = {"model": NAME, "prompt": prompt, "max_tokens": 44, "ignore_eos": True}
        done = (await client.post("/v1/completions", json=fits)).json()
        prompt_tokens = done["usage"]["prompt_tokens"]
        assert prompt_tokens + done["usage"]["completion_tokens"] <= 64
        over = {**fits, "max_tokens": 65 - prompt_tokens}
        error = assert_error(await client.post("/v1/completions", json=over), 400, "max_tokens")
        assert error["message"] == (
            f"max_tokens is too large: {65 - prompt_tokens}. This model's maximum context "
            f"length is 64 tokens and your request has {prompt_tokens} input tokens "
            f"({65 - prompt_tokens} > 64 - {prompt_tokens})"
        )
        chat = {
            "model": NAME,
            "messages": [{"role": "user", "content": prompt}],
            "ignore_eos": True,
            "max_completion_tokens": 64,
        }
        assert_error(await client.post("/v1/chat/completions", json=chat), 400, "max_tokens")
        del chat["max_completion_tokens"]  # the rest of the context
        whole = (await client.post("/v1/chat/completions", json=chat)).json()
        usage = whole["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        assert whole["choices"][0]["finish_reason"] == "length"
        assert (await client.post("/v1/completions", json=fits)).status_code == 200
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


async def test_api_key(tiny_model, shared_manager):
    async with running(tiny_model, shared_manager, api_key="s3cret") as (_, client):
        assert_error(await client.get("/v1/models"), 401, None)
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def post_then_hang_up(
    port: int, path: str, body: dict, engine: Engine, until: bytes | None
) -> None:
    """POST over a raw socket; close it once the request runs (the first streamed bytes
    holding `until`, or running)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    async with await anyio.connect_tcp("127.0.0.1", port) as conn:
        await conn.send(head + data)
        if until is not None:
            received = b""
            while until not in received:
                received += await conn.receive()
        else:
            with anyio.fail_after(10):
                while engine.stats().num_running == 0:  # noqa: ASYNC110 (no such event)
                    await anyio.sleep(0.01)


LONG_OLLAMA = {"model": NAME, "prompt": "w5 w6", "options": {"num_predict": 400}}


@pytest.mark.parametrize(
    "path, body, until",
    [
        ("/v1/completions", {"max_tokens": 400, "ignore_eos": True, "stream": True}, b"data: "),
        ("/v1/completions", {"max_tokens": 400, "ignore_eos": True, "stream": False}, None),
        ("/api/generate", {**LONG_OLLAMA, "stream": True}, b'"response"'),
        ("/api/generate", {**LONG_OLLAMA, "stream": False}, None),
    ],
)
async def test_disconnect_aborts_the_request(server, path, body, until):
    engine, client = server
    steps_before = engine.stats().num_steps
    body = {"prompt": "w5 w6", **body}
    await post_then_hang_up(client.base_url.port, path, body, engine, until)
    with anyio.fail_after(10):
        await engine.wait_until_idle()
    assert engine.stats().num_running == 0
    assert engine.stats().num_steps - steps_before < 300  # aborted, far from 400 tokens
    # The engine still serves.
    again = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert again.status_code == 200


def test_chat_template_file_exists(chat_model):
    assert "chat_template" in json.loads((Path(chat_model) / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_loom_serve_cli_stops_cleanly_on_sigterm(tiny_model, shared_manager, loop):
    import signal
    import subprocess
    import sys
    import time

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "loomllm.cli.main",
        "serve",
        tiny_model,
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--dtype",
        "float32",
        "--loop",
        loop,
        "--manager-socket",
        str(shared_manager.socket),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "loom serve did not come up"
                time.sleep(0.1)
        assert health.status_code == 200
        body = {"model": NAME, "prompt": "w5", "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_loom_generate_streams_to_stdout(tiny_model, shared_manager):
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "loomllm.cli.main",
        "generate",
        tiny_model,
        "w5 w6",
        "--max-tokens",
        "4",
        "--dtype",
        "float32",
        "--manager-socket",
        str(shared_manager.socket),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) >= 1 and result.stdout.endswith("\n")


def test_an_engine_dead_at_a_requests_start_is_503_and_closes_what_started():
    """The engine's worker died between the request's arrival and its prompts' start: 503
    (retry: the supervisor restarts the engine), as for a death mid-request, not a 500."""
    from loomllm.errors import EngineDeadError
    from loomllm.server.bodies.openai_bodies import CompletionBody
    from loomllm.server.openai.body_parsing import parse
    from loomllm.server.openai.schemas import ApiError, parse_completion
    from loomllm.server.openai.serving import start_streams

    closed = []

    class Stream:
        def close(self):
            closed.append(self)

    class DyingEngine:
        def __init__(self):
            self.calls = 0

        def generate(self, prompt, params, request_id, priority, max_tokens_must_fit, lora_request):
            self.calls += 1
            if self.calls == 2:
                raise EngineDeadError("the worker died")
            return Stream()

    req = parse_completion(parse(CompletionBody, {"prompt": ["w5", "w6", "w7"]}))
    with pytest.raises(ApiError) as caught:
        start_streams(DyingEngine(), req.prompts, req, "cmpl-x")
    assert caught.value.status == 503 and "the worker died" in caught.value.message
    assert len(closed) == 1  # the first prompt's request, aborted
