"""End to end: `loom serve --runner pooling` (asyncio and trio) and the official `openai`
client's embeddings.create, float and base64, equal to transformers' own; /v1/score and
/v1/rerank by cosine, and by a cross-encoder as sentence-transformers scores; /classify;
bad-input tables for these routes, each a 4xx naming the field, the server serving on."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from support.hf_reference import hf_embedding
from support.models import make_pooling_model, make_tiny_encoder
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
        ({"route": "score", "text_1": "w5"}, 400, "text_2"),
        ({"route": "score", "text_1": ["w5", "w6"], "text_2": ["w7"] * 3}, 400, "text_1"),
        ({"route": "score", "text_1": [""], "text_2": "w5"}, 400, "text_1"),
        ({"route": "rerank", "documents": ["w5"]}, 400, "query"),
        ({"route": "rerank", "query": "w5", "documents": "w6"}, 400, "documents"),
        ({"route": "rerank", "query": "w5", "documents": ["w6"], "top_n": 0}, 400, "top_n"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_the_server_serves_on(
    embed_server, body, status, param
):
    body = dict(body)  # shared by both loops' runs
    url = embed_server.base_url + "/v1/" + body.pop("route", "embeddings")
    answer = httpx.post(url, json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    ok = httpx.post(embed_server.base_url + "/v1/embeddings", json={"input": "w5"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_generation_routes_refuse_on_a_pooling_server(embed_server):
    answer = httpx.post(
        embed_server.base_url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2}
    )
    assert answer.status_code == 400 and "runner='pooling'" in answer.text
    assert httpx.get(embed_server.base_url + "/health").status_code == 200


def test_score_and_rerank_rank_by_cosine(embed_server):
    base = embed_server.base_url + "/v1/"
    query, documents = "w5 w6 w7", ["w40 w41", "w5 w6 w7", "w5 w6 w8"]
    scores = httpx.post(base + "score", json={"text_1": query, "text_2": documents}).json()
    values = [d["score"] for d in scores["data"]]
    assert [d["index"] for d in scores["data"]] == [0, 1, 2]
    assert values[1] == pytest.approx(1.0, abs=1e-5) and max(values) == values[1]
    assert scores["usage"]["prompt_tokens"] == 3 * 3 + 2 + 3 + 3
    ranked = httpx.post(
        base + "rerank", json={"query": query, "documents": documents, "top_n": 2}
    ).json()
    order = sorted(range(3), key=lambda i: -values[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert ranked["results"][0]["document"] == {"text": documents[order[0]]}
    for result in ranked["results"]:
        assert result["relevance_score"] == pytest.approx(values[result["index"]], abs=1e-5)


@pytest.fixture(scope="module")
def classifier_server(tmp_path_factory, shared_manager) -> Iterator[tuple[LoomServer, str, str]]:
    """One `loom serve` with a cross-encoder ("reranker") and, from a models file, a
    three-label classifier ("labeler"): BERT classifiers, runner pooling."""
    root = tmp_path_factory.mktemp("classifiers")
    reranker = make_tiny_encoder(root / "reranker", "bert", num_labels=1)
    labeler = make_tiny_encoder(root / "labeler", "bert", seed=3, num_labels=3)
    models_file = root / "models.toml"
    models_file.write_text(f'[models.labeler]\nmodel = "{labeler}"\n')
    extra = ("--runner", "pooling", "--models-file", str(models_file))
    with loom_serve(reranker, shared_manager.socket, "reranker", "trio", *extra) as running:
        yield running, reranker, labeler


def test_a_cross_encoder_reranks_as_sentence_transformers_scores(classifier_server):
    from sentence_transformers import CrossEncoder

    server, reranker, _ = classifier_server
    # No word starting "w1" or "w2" (the special tokens, matched inside words).
    query, documents = "w5 w6 w7", ["w40 w41", "w5 w6 w7", "w8 w9 w30 w31"]
    expected = CrossEncoder(reranker, device="cpu").predict([(query, d) for d in documents])
    for route in ("/v1/rerank", "/rerank"):
        ranked = httpx.post(
            server.base_url + route,
            json={"model": "reranker", "query": query, "documents": documents},
        ).json()
        by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-expected))
        assert max(abs(by_index[i] - expected[i]) for i in range(3)) < TOLERANCE
    scores = httpx.post(
        server.base_url + "/score",
        json={"model": "reranker", "text_1": query, "text_2": documents},
    ).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(list(expected), abs=TOLERANCE)


def test_classify_route_gives_each_input_its_labels_probabilities(classifier_server):
    import transformers

    server, _, labeler = classifier_server
    texts = ["w5 w6 w7", "w40 w41"]
    answer = httpx.post(server.base_url + "/classify", json={"model": "labeler", "input": texts})
    assert answer.status_code == 200, answer.text
    model = transformers.AutoModelForSequenceClassification.from_pretrained(labeler).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(labeler)
    with torch.inference_mode():
        expected = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
    data = answer.json()["data"]
    assert [d["num_classes"] for d in data] == [3, 3]
    assert (torch.tensor([d["probs"] for d in data]) - expected).abs().max() < TOLERANCE
    assert [d["label"] for d in data] == [f"label-{int(i)}" for i in expected.argmax(-1)]


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/classify", {"model": "labeler", "input": []}, 400, "input"),
        ("/classify", {"model": "labeler", "input": ["w5"] * 10_000}, 400, "input"),
        ("/classify", {"model": "labeler", "input": [3.5]}, 400, "input"),
        ("/classify", {"model": "nope", "input": "w5"}, 404, "model"),
        ("/v1/embeddings", {"model": "reranker", "input": "w5"}, 400, "model"),
        ("/v1/score", {"model": "labeler", "text_1": "w5", "text_2": "w6"}, 400, "text_1"),
        ("/v1/chat/completions", {"model": "labeler", "messages": []}, 400, "messages"),
    ],
)
def test_classifier_bad_input_is_a_4xx_naming_the_field(
    classifier_server, route, body, status, param
):
    server = classifier_server[0]
    answer = httpx.post(server.base_url + route, json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    ok = httpx.post(server.base_url + "/classify", json={"model": "labeler", "input": "w5"})
    assert ok.status_code == 200
