"""End to end: `loom serve --enable-lora --lora-modules ...` and the official `openai` client
picking two LoRA adapters, and the base model, by `model`: each answer transformers' with the
adapter merged; /v1/models lists them; vLLM's load/unload routes; an unknown adapter is a 404."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from support.models import lora_reference, make_lora_adapter
from support.servers import LoomServer, loom_serve

from loomllm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.compute

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-loras")
    return {
        "sql": make_lora_adapter(tiny_model, root / "sql", 5, ["q_proj", "v_proj", "down_proj"]),
        "chat": make_lora_adapter(tiny_model, root / "chat", 6, ["o_proj", "up_proj"], rank=8),
        "late": make_lora_adapter(tiny_model, root / "late", 7, ["k_proj"], rank=2),
    }


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def server(request, tiny_model, adapters, shared_manager) -> Iterator[LoomServer]:
    modules = [f"{name}={adapters[name]}" for name in ("sql", "chat")]
    extra = ("--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating")
    with loom_serve(
        tiny_model, shared_manager.socket, "tiny", request.param, *extra, "--lora-modules", *modules
    ) as running:
        yield running


def words(text: str) -> list[str]:
    """An answer's words ("w17 w4" is tokens 17, 4): spacing aside, its tokens."""
    return text.split()


def expected_words(model: str, adapter: str | None) -> list[str]:
    ids = lora_reference(model, adapter, PROMPT, MAX_TOKENS)
    return words(Tokenizer.from_model_dir(model).decode(ids))


def test_openai_client_picks_adapters_by_model(server, tiny_model, adapters):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
        listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert listed == {"tiny": None, "sql": "tiny", "chat": "tiny"}
        texts = {}
        for model in ("sql", "chat", "tiny"):
            answer = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
            )
            assert answer.model == model
            texts[model] = answer.choices[0].text
        with pytest.raises(openai.NotFoundError, match="'nope'"):
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert words(texts["sql"]) == expected_words(tiny_model, adapters["sql"])
    assert words(texts["chat"]) == expected_words(tiny_model, adapters["chat"])
    assert words(texts["tiny"]) == expected_words(tiny_model, None)
    assert len(set(texts.values())) == 3


def test_adapters_load_and_unload_at_runtime(server, tiny_model, adapters):
    base = server.base_url + "/v1/"
    body = {"model": "late", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    assert httpx.post(base + "completions", json=body).status_code == 404
    loaded = httpx.post(
        base + "load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]}
    )
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(
        base + "load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    nowhere = httpx.post(base + "load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert nowhere.status_code == 400 and nowhere.json()["error"]["param"] == "lora_path"
    answer = httpx.post(base + "completions", json=body).json()
    assert words(answer["choices"][0]["text"]) == expected_words(tiny_model, adapters["late"])
    assert httpx.post(base + "unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert httpx.post(base + "completions", json=body).status_code == 404
    gone = httpx.post(base + "unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
