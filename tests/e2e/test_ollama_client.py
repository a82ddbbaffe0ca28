"""End to end: the official `ollama` client against a real `loom serve` (asyncio and trio):
chat and generate, streamed and not, embed, list, ps and show; its errors as Ollama's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest
import torch
from support.hf_reference import hf_embedding
from support.models import make_pooling_model
from support.servers import LoomServer, loom_serve

pytestmark = pytest.mark.compute

NAME = "tiny"
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def server(request, chat_model, shared_manager) -> Iterator[LoomServer]:
    with loom_serve(chat_model, shared_manager.socket, NAME, request.param) as running:
        yield running


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory, shared_manager) -> Iterator[tuple[LoomServer, str]]:
    model = make_pooling_model(tmp_path_factory.mktemp("pooling"), "qwen3", "mean_tokens")
    with loom_serve(model, shared_manager.socket, "embedder", "trio", "--runner", "pooling") as s:
        yield s, model


@pytest.fixture
def client(server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


def openai_chat(server: LoomServer, content: str) -> str:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": GREEDY["num_predict"],
    }
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    return answer.json()["choices"][0]["message"]["content"]


def test_chat_and_generate_streamed_and_not(server, client):
    messages = [{"role": "user", "content": "w5 w6"}]
    whole = client.chat(model=NAME, messages=messages, options=GREEDY)
    pieces = list(client.chat(model=NAME, messages=messages, options=GREEDY, stream=True))
    assert whole.done and whole.message.role == "assistant"
    assert whole.message.content == openai_chat(server, "w5 w6")  # the same greedy answer
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert 1 <= whole.eval_count <= GREEDY["num_predict"]
    assert whole.prompt_eval_count and whole.total_duration > 0
    generated = client.generate(model=NAME, prompt="w5 w6", options=GREEDY)
    assert generated.response == whole.message.content  # the prompt through the template
    streamed = list(client.generate(model=NAME, prompt="w5 w6", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == generated.response
    loaded = client.generate(model=NAME, prompt="")  # Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load"
    loaded = client.chat(model=NAME, messages=[])  # its other way, on /api/chat
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_list_ps_and_show(client):
    assert [m.model for m in client.list().models] == [NAME]
    running = client.ps().models
    assert [m.model for m in running] == [NAME] and running[0].context_length == 512
    shown = client.show(NAME)
    assert shown.capabilities == ["completion"] and shown.details.family == "llama"
    assert "add_generation_prompt" in shown.template  # the model's chat template


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: c.chat(model="nope", messages=[{"role": "user", "content": "w5"}]), 404, "nope"),
        (lambda c: c.generate(model=NAME, prompt="w5", options={"mirostat": 2}), 400, "mirostat"),
        (lambda c: c.generate(model=NAME, prompt="w5", options={"warp": 1}), 400, "warp"),
        (
            lambda c: c._request_raw(
                "POST", "/api/generate", json={"model": NAME, "prompt": "w5", "format": "yaml"}
            ),
            400,
            "format",
        ),
        (
            lambda c: c.chat(
                model=NAME, messages=[{"role": "user", "content": "w5", "images": ["aGk="]}]
            ),
            400,
            "images",
        ),
        (lambda c: c.embed(model=NAME, input="w5"), 400, "runner='generate'"),
    ],
)
def test_errors_are_ollamas_and_the_server_serves_on(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as err:
        call(client)
    assert err.value.status_code == status and words in err.value.error
    assert client.generate(model=NAME, prompt="w5", options=GREEDY).done


def test_embed(pooling_server):
    server, model = pooling_server
    with ollama.Client(host=server.base_url) as client:
        answer = client.embed(model="embedder", input=["w5 w6", "w7"])
        assert client.show("embedder").capabilities == ["embedding"]
    assert answer.prompt_eval_count == 3
    for vector, ids in zip(answer.embeddings, [[5, 6], [7]], strict=True):
        expected = hf_embedding(model, ids, "mean_tokens", normalize=True)
        assert (torch.tensor(vector) - expected).abs().max() < 1e-4
