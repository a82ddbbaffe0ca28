"""--reasoning-parser: a thinking model's <think>...</think> split out into the message's
`reasoning`, whole or streamed however the text is cut, alone and before "auto" tool calls;
through the server on a tiny model whose tokens are characters, its answers scripted on the
workers (one-hot logits), so the real step loop, detokenizer and server shape them. asyncio
and trio.
"""

from __future__ import annotations

import random
from contextlib import asynccontextmanager

import anyio
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.servers import running, sse_events
from support.tools import TOOLS, WEATHER_CALL, calls_of
from support.worker_hooks import script_answers, unscript_answers

from loomllm.server.openai.chat_template_fields import FIELDS as TEMPLATE_FIELDS
from loomllm.server.parsers.reasoning import ReasoningDeltas, split_reasoning

# (parser, answer, reasoning, content)
CASES = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "It is 4."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "It is 4.", None, "It is 4."),  # enable_thinking: false
    ("qwen3", "<think>cut while thinking", "cut while thinking", None),
    ("qwen3", "<thi", None, "<thi"),  # cut inside a tag that never was one
    (
        "qwen3",
        "4 </think> is text without an opening",
        None,
        "4 </think> is text without an opening",
    ),
    ("deepseek_r1", "The prompt opened it.</think>It is 4.", "The prompt opened it.", "It is 4."),
    ("deepseek_r1", "<think>x < y </thin</think>\n", "x < y </thin", None),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", None),
    # only the newlines after </think> go: code keeps its indentation
    ("qwen3", "<think>ok</think>\n\n    x = 1\n    y = 2", "ok", "    x = 1\n    y = 2"),
]
# (prompt's end, parser, answer, reasoning, content): the prompt says where the answer starts
AFTER_PROMPTS = [
    (
        "<|im_start|>assistant\n<think>\n",
        "qwen3",
        "Let me think.\n</think>\n\nIt is 4.",
        "Let me think.\n",
        "It is 4.",
    ),  # Qwen3-2507 thinking: the template opens it
    (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "deepseek_r1",
        "It is 4.",
        None,
        "It is 4.",
    ),  # enable_thinking: false closes an empty block
    (
        "<think>old</think> earlier turn\nassistant:",
        "deepseek_r1",
        "Hm.</think>4",
        "Hm.",
        "4",
    ),  # a closed block earlier: the parser's own rule
    (None, "qwen3", "Let me think.</think>4", None, "Let me think.</think>4"),
]


@pytest.mark.parametrize("parser, answer, reasoning, content", CASES)
def test_whole_and_streamed_answers_split_alike(parser, answer, reasoning, content):
    assert split_reasoning(parser, answer) == (reasoning, content)
    rng = random.Random(0)
    cuttings = [list(range(1, len(answer) + 1))]  # character by character
    cuttings += [
        sorted({*rng.sample(range(1, len(answer)), min(4, len(answer) - 1)), len(answer)})
        for _ in range(20)
    ]
    for cuts in cuttings:
        deltas, got_reasoning, got_content, start = ReasoningDeltas(parser), "", "", 0
        for end in cuts:
            r, c = deltas.next(0, answer[start:end], last=end == len(answer))
            got_reasoning, got_content, start = got_reasoning + r, got_content + c, end
        assert (got_reasoning or None, got_content or None) == (reasoning, content), cuts


@pytest.mark.parametrize("prompt, parser, answer, reasoning, content", AFTER_PROMPTS)
def test_the_prompt_says_where_the_answer_starts(prompt, parser, answer, reasoning, content):
    assert split_reasoning(parser, answer, prompt) == (reasoning, content)
    deltas, got_reasoning, got_content = ReasoningDeltas(parser), "", ""
    for i, char in enumerate(answer):  # streamed: the prompt read with the first text
        r, c = deltas.next(0, char, last=i == len(answer) - 1, prompt=prompt if i == 0 else None)
        got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ReasoningDeltas("r2")


ASK = {
    "messages": [{"role": "user", "content": "2+2?"}],
    "max_tokens": 300,
    "temperature": 0.8,
    "logprobs": True,
}


@asynccontextmanager
async def scripted_server(char_model, manager, answers: list[tuple[dict, str]], **app_options):
    """A server whose chat answer to each body in `answers` is the text paired with it, then
    eos."""
    async with running(char_model, manager, **app_options) as (engine, client):
        scripts = {}
        for body, text in answers:
            fields = {k: body[k] for k in TEMPLATE_FIELDS if k in body}
            counted = await client.post("/tokenize", json={"messages": body["messages"], **fields})
            prompt = counted.json()["tokens"]
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            assert engine.tokenizer.decode(ids) == text
            scripts[tuple(prompt)] = ids + list(engine.tokenizer.eos_token_ids)[:1]
        await engine.collective_rpc(script_answers, scripts)
        try:
            yield client
        finally:
            with anyio.CancelScope(shield=True):  # the workers are shared: never left scripted
                await engine.collective_rpc(unscript_answers)


async def chat_both_ways(client, body: dict) -> tuple[dict, list[dict]]:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    whole = response.json()
    ChatCompletion.model_validate(whole)
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        events = await sse_events(response)
    for event in events[:-1]:
        ChatCompletionChunk.model_validate(event)
    return whole, [e["choices"][0] for e in events[:-1]]


@pytest.mark.anyio
async def test_reasoning_then_tool_calls_through_the_server(char_model, shared_manager):
    thinking = "\nThe user wants the weather.\n"
    answer = f"<think>{thinking}</think>\n\nChecking.\n{WEATHER_CALL}"
    body = {**ASK, "tools": TOOLS}
    async with scripted_server(
        char_model,
        shared_manager,
        [(body, answer)],
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    ) as client:
        whole, chunks = await chat_both_ways(client, body)
        (choice,) = whole["choices"]
        message = choice["message"]
        assert message["reasoning"] == message["reasoning_content"] == thinking
        assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
        assert calls_of(message["tool_calls"]) == [("weather", {"unit": "c", "rain": True})]
        deltas = [c["delta"] for c in chunks]
        assert "".join(d.get("reasoning") or "" for d in deltas) == thinking
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == thinking
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls_of(streamed_calls, streamed=True) == calls_of(message["tool_calls"])
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # Every token's logprob arrives once, held text's too, in order.
        streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
        assert [e["token"] for e in streamed] == [e["token"] for e in choice["logprobs"]["content"]]
        assert len(streamed) == whole["usage"]["completion_tokens"]


@pytest.mark.anyio
async def test_deepseek_r1_and_what_skips_the_parser(char_model, shared_manager):
    body = {**ASK, "max_tokens": 100}
    grammar = {
        **body,
        "messages": [{"role": "user", "content": "Again?"}],  # not scripted
        "structured_outputs": {"choice": ["4</think>4"]},
    }
    async with scripted_server(
        char_model, shared_manager, [(body, "Sum.</think>\n4")], reasoning_parser="deepseek_r1"
    ) as client:
        whole, chunks = await chat_both_ways(client, body)
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("Sum.", "4")
        deltas = [c["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == "4"
        # A grammar holds from the first token: the answer is all content.
        response = await client.post("/v1/chat/completions", json=grammar)
        assert response.status_code == 200, response.text
        constrained = response.json()
        message = constrained["choices"][0]["message"]
        assert message["content"] == "4</think>4" and "reasoning" not in message
