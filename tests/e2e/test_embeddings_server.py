"""End to end: `loom serve --runner pooling` (asyncio and trio) and the official `openai`
client's embeddings.create, float and base64, equal to transformers' own; a bad-input table
for /v1/embeddings, each a 4xx naming the field, the server serving on."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from support.hf_reference import hf_embedding
from support.models import make_pooling_model
from support.servers import LoomServer, loom_serve

pytestmark = pytest.mark.compute

NAME = "tiny-embed"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pooling_model(tmp_path_factory) -> str:
    return make_pooling_model(tmp_path_factory.mktemp("pooling"), "qwen3", "mean_tokens")


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def embed_server(request, pooling_model, shared_manager) -> Iterator[LoomServer]:
    with loom_serve(
        pooling_model, shared_manager.socket, NAME, request.param, "--runner", "pooling"
    ) as running:
        yield running


def test_openai_client_embeddings_float_and_base64(embed_server, pooling_model):
    texts = ["w5 w6 w7", "w9 w10", "w11"]
    with openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="x", max_retries=0) as c:
        floats = c.embeddings.create(model=NAME, input=texts, encoding_format="float")
        packed = c.embeddings.create(model=NAME, input=texts, encoding_format="base64")
        by_ids = c.embeddings.create(model=NAME, input=[[5, 6, 7]])
    tokens = [[int(w[1:]) for w in text.split()] for text in texts]  # token i is "w{i}"
    assert floats.usage.prompt_tokens == sum(len(t) for t in tokens)
    for i, ids in enumerate(tokens):
        expected = hf_embedding(pooling_model, ids, "mean_tokens", normalize=True)
        assert floats.data[i].index == i
        assert (torch.tensor(floats.data[i].embedding) - expected).abs().max() < TOLERANCE
        # base64: float32 values, little-endian (the client hands the text over as it is).
        # A batch formed otherwise may differ in the last bits.
        decoded = np.frombuffer(base64.b64decode(packed.data[i].embedding), dtype="<f4")
        assert np.abs(decoded - np.array(floats.data[i].embedding)).max() < 1e-6
    assert np.abs(np.array(by_ids.data[0].embedding) - floats.data[0].embedding).max() < 1e-6


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["w5"] * 10_000}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": ["w5", 3.5]}, 400, "input"),
        ({"input": [[5, 10**9]]}, 400, "input"),
        ({"input": "w5", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "w5", "dimensions": 8}, 400, "dimensions"),
        ({"input": "w5", "dimensions": "8"}, 400, "dimensions"),
        ({"input": "w5", "model": "other"}, 404, "model"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_the_server_serves_on(
    embed_server, body, status, param
):
    url = embed_server.base_url + "/v1/embeddings"
    answer = httpx.post(url, json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    ok = httpx.post(url, json={"input": "w5"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_generation_routes_refuse_on_a_pooling_server(embed_server):
    answer = httpx.post(
        embed_server.base_url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2}
    )
    assert answer.status_code == 400 and "runner='pooling'" in answer.text
    assert httpx.get(embed_server.base_url + "/health").status_code == 200
