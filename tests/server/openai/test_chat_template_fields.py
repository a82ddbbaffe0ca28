"""The chat route's template fields (vLLM's extras): continue_final_message and echo, a named
or (trusted) sent chat_template, chat_template_kwargs, documents; /tokenize renders the same
prompt. The prompts are checked against transformers' apply_chat_template. asyncio and trio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from support.servers import NAME, assert_error, running, sse_events
from transformers import AutoTokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
PREFILLED = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7 "}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
GREEDY = {"model": NAME, "max_completion_tokens": 4, "temperature": 0, "ignore_eos": True}


def reference_ids(model: str, messages: list, **kwargs) -> list[int]:
    """The prompt as transformers renders it, encoded by the model's tokenizer.json (the
    tiny model's whole-word vocabulary: transformers' own wrapper splits w11 apart)."""
    text = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    raw = tokenizers.Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return raw.encode(text, add_special_tokens=False).ids


async def test_continue_final_message_with_echo(chat_model, shared_manager):
    expected = reference_ids(
        chat_model, PREFILLED, add_generation_prompt=False, continue_final_message=True
    )
    body = {**GREEDY, "messages": PREFILLED, **CONTINUE, "echo": True}
    async with running(chat_model, shared_manager) as (_, client):
        counted = (await client.post("/tokenize", json={"messages": PREFILLED, **CONTINUE})).json()
        assert counted["tokens"] == expected
        whole = (await client.post(CHAT, json=body)).json()
        assert whole["usage"]["prompt_tokens"] == len(expected)
        # The same greedy tokens as the reference prompt's own completion.
        plain = await client.post(
            "/v1/completions",
            json={
                "model": NAME,
                "prompt": expected,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        answer = plain.json()["choices"][0]["text"]
        assert whole["choices"][0]["message"]["content"] == "w6 w7 " + answer
        async with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
            events = await sse_events(response)
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": "w6 w7 "}
        assert "".join(d.get("content") or "" for d in deltas) == "w6 w7 " + answer
        # Without echo, or when the final message is the user's, nothing is put before it.
        unechoed = (await client.post(CHAT, json={**body, "echo": False})).json()
        assert unechoed["choices"][0]["message"]["content"] == answer
        user_last = {**GREEDY, "messages": PREFILLED[:1]}
        answers = [
            (await client.post(CHAT, json={**user_last, "echo": echo})).json()
            for echo in (True, False)
        ]
        echoed, plain = (a["choices"][0]["message"]["content"] for a in answers)
        assert echoed == plain


async def test_continuing_an_empty_prefill_starts_the_answer(chat_model, shared_manager):
    empty = [PREFILLED[0], {"role": "assistant", "content": ""}]
    expected = reference_ids(
        chat_model, empty, add_generation_prompt=False, continue_final_message=True
    )
    async with running(chat_model, shared_manager) as (_, client):
        counted = await client.post("/tokenize", json={"messages": empty, **CONTINUE})
        assert counted.json()["tokens"] == expected


async def test_bad_template_fields_are_400_and_the_server_goes_on(chat_model, shared_manager):
    body = {**GREEDY, "messages": PREFILLED}
    async with running(chat_model, shared_manager) as (_, client):
        for extra, param in [
            ({"continue_final_message": True}, "continue_final_message"),  # needs agp: false
            ({"add_generation_prompt": "no"}, "add_generation_prompt"),
            ({"chat_template": "{{ 7 }}"}, "chat_template"),  # text: not trusted here
            ({"chat_template": ""}, "chat_template"),
            ({"chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
            ({"documents": [1]}, "documents"),
            ({"echo": 1}, "echo"),
        ]:
            for path in (CHAT, "/tokenize"):
                if path == "/tokenize" and param == "echo":
                    continue
                payload = {**body, **extra} if path == CHAT else {"messages": PREFILLED, **extra}
                assert_error(await client.post(path, json=payload), 400, param)
        no_text = [PREFILLED[0], {"role": "assistant", "tool_calls": []}]
        response = await client.post(CHAT, json={**body, "messages": no_text, **CONTINUE})
        error = assert_error(response, 400, "messages")
        assert "needs the final message's text content" in error["message"]
        # Fields of the template are checked when /tokenize tokenizes a prompt, too.
        response = await client.post("/tokenize", json={"prompt": "w5", "chat_template": "x"})
        assert_error(response, 400, "chat_template")
        # A template variable may be named as the renderer's own parameters are.
        for path, payload in ((CHAT, body), ("/tokenize", {"messages": PREFILLED})):
            named = {**payload, "chat_template_kwargs": {"self": 1, "kwargs": 2}}
            assert (await client.post(path, json=named)).status_code == 200
        # The model's own template, by name, needs no trust.
        named = await client.post(CHAT, json={**body, "chat_template": "default"})
        plain = await client.post(CHAT, json=body)
        assert named.status_code == plain.status_code == 200
        assert named.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        doc = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert doc["ChatBody"]["properties"]["chat_template"]["enum"] == [
            "default",
            None,
        ]


async def test_a_trusted_template_its_variables_and_documents(chat_model, shared_manager):
    template = (
        "{{ greeting }} {% for d in documents or [] %}{{ d.text }} {% endfor %}"
        "{{ messages[-1].content }}"
    )
    kwargs = {
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "w3"},
        "documents": [{"text": "w4"}],
    }
    expected = reference_ids(
        chat_model, PREFILLED[:1], chat_template=template, greeting="w3", documents=[{"text": "w4"}]
    )
    async with running(chat_model, shared_manager, trust_request_chat_template=True) as (_, client):
        counted = await client.post("/tokenize", json={"messages": PREFILLED[:1], **kwargs})
        assert counted.json()["tokens"] == expected
        whole = await client.post(CHAT, json={**GREEDY, "messages": PREFILLED[:1], **kwargs})
        assert whole.json()["usage"]["prompt_tokens"] == len(expected) == 3
        broken = {**kwargs, "chat_template": "{% for %}"}
        response = await client.post(CHAT, json={**GREEDY, "messages": PREFILLED, **broken})
        assert "does not compile" in assert_error(response, 400, "chat_template")["message"]
        assert (await client.post(CHAT, json={**GREEDY, "messages": PREFILLED})).status_code == 200
        doc = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert doc["ChatBody"]["properties"]["chat_template"]["type"] == [
            "string",
            "null",
        ]
