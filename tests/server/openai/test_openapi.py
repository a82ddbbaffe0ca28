"""GET /openapi.json, and schemathesis run against it: no 5xx and no schema violation.

A real `loom serve` (the tiny chat model; max_model_len 8 keeps every generation a few
steps long; an API key, so 401s and the security scheme are tested too) and the
schemathesis CLI with a fixed seed and a bounded number of cases per operation.
schemathesis_hooks.py narrows positive cases to what JSON Schema cannot state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from support.models import make_pooling_model
from support.paths import TESTS_ROOT
from support.servers import loom_serve

from loomllm.server.openai.openapi import build_openapi

NAME = "tiny"
KEY = "test-key"
MAX_MODEL_LEN = 8
V1 = {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"}
POOLING = {
    "POST /v1/embeddings",
    "POST /v1/score",
    "POST /v1/rerank",
    "POST /score",
    "POST /rerank",
}
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "positive_data_acceptance",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
    "missing_required_header",
]


def labels(doc: dict) -> set[str]:
    """The operations schemathesis finds in `doc`, once the document passed its validation."""
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    return {result.ok().label for result in schema.get_all_operations()}


def guarded(model: str, manager, loop: str, *args: str) -> Iterator[str]:
    """The base URL of a `loom serve` of `model` with the API key and MAX_MODEL_LEN, on a
    free loopback port; SIGTERM at the end (exit 0)."""
    flags = ("--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), *args)
    with loom_serve(model, manager.socket, NAME, loop, *flags) as running:
        yield running.base_url


@pytest.fixture(scope="module")
def guarded_server(chat_model, shared_manager) -> Iterator[str]:
    yield from guarded(chat_model, shared_manager, "asyncio")


def test_built_document_is_valid_openapi_with_the_servers_limits():
    doc = build_openapi("m", 16, 100)
    assert labels(doc) >= V1
    assert "securitySchemes" not in doc["components"]
    schemas = doc["components"]["schemas"]
    untruncated = schemas["CompletionBody"]["allOf"][1]["else"]  # no truncate_prompt_tokens
    prompt = untruncated["properties"]["prompt"]["anyOf"]
    ids = [p for p in prompt if p.get("items", {}).get("type") == "integer"]
    assert ids == [
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 15,
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
        }
    ]
    assert schemas["ChatBody"]["properties"]["model"]["enum"] == ["m", None]
    assert "401" not in doc["paths"]["/v1/completions"]["post"]["responses"]


@pytest.mark.parametrize("vocab", [1, 2, 10, 11, 100, 101, 256, 1000, 32000, 49152, 151936])
def test_logit_bias_keys_are_the_vocabulary_s_ids_in_decimal(vocab):
    doc = build_openapi("m", 16, vocab)
    bias = doc["components"]["schemas"]["CompletionBody"]["properties"]["logit_bias"]
    key = re.compile(bias["propertyNames"]["pattern"])
    assert [i for i in range(2 * vocab + 100) if key.search(str(i))] == list(range(vocab))
    assert not any(key.search(k) for k in ("00", "01", "-1", "", "1.0", " 1", "1a", "1\n"))


def test_served_document_needs_no_key_and_names_the_key_elsewhere(guarded_server):
    response = httpx.get(f"{guarded_server}/openapi.json")  # an open path, as /health
    assert response.status_code == 200
    doc = response.json()
    assert labels(doc) == V1 | {"POST /tokenize", "POST /detokenize", "GET /health", "GET /version"}
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        (operation,) = doc["paths"][path].values()
        assert operation["security"] == [{"bearer": []}] and "401" in operation["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]
    card = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
    assert card["schema"]["properties"]["data"]["items"]["properties"]["max_model_len"] == {
        "const": MAX_MODEL_LEN
    }


def test_what_fuzzing_found_stays_fixed(guarded_server):
    client = httpx.Client(
        base_url=guarded_server, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    with client:
        ok = {"prompt": "w5", "max_tokens": 2}
        # An integer past 64 bits in a number field once killed the engine (msgpack): now it
        # is read as the float it is, and one past any float is a 400.
        response = client.post("/v1/completions", json=ok | {"temperature": 2**70})
        assert response.status_code == 200, response.text
        response = client.post("/v1/completions", json=ok | {"temperature": 10**400})
        assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
        assert client.post("/v1/completions", json=ok).status_code == 200
        # JSON's 2.0 is the integer 2 (pydantic, so OpenAI and vLLM, read it so).
        response = client.post("/v1/completions", json={"prompt": [5.0, 6], "max_tokens": 2.0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        # Fields the route does not use are still checked.
        chat = {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 1}
        response = client.post("/v1/chat/completions", json=chat | {"max_tokens": "x"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        response = client.post("/tokenize", json={"messages": chat["messages"], "prompt": 5})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        # 405 names the allowed methods (RFC 9110).
        response = client.put("/v1/completions")
        assert response.status_code == 405 and response.headers["allow"] == "POST"


def schemathesis_run(base_url: str, eos: int, tmp_path: Path) -> str:
    """The schemathesis CLI over every operation of the served document; its report."""
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "20",
        "--seed",
        "1",
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--no-color",
        "--header",
        f"Authorization: Bearer {KEY}",
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks",
        "LOOM_TEST_BASE_URL": base_url,
        "LOOM_TEST_API_KEY": KEY,
        "LOOM_TEST_EOS_IDS": str(eos),
        "PYTHONPATH": os.pathsep.join([str(TESTS_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    print(result.stdout)  # the report, for -s or a failure
    assert result.returncode == 0, result.stdout[-30000:] + result.stderr[-5000:]
    assert "No issues found" in result.stdout
    return result.stdout


def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    guarded_server, chat_model, tmp_path
):
    # Every operation: the /v1 routes the issue names and the four small ones beside them.
    eos = json.loads((Path(chat_model) / "config.json").read_text())["eos_token_id"]
    report = schemathesis_run(guarded_server, eos, tmp_path)
    assert "7 selected / 7 total" in report


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory, shared_manager) -> Iterator[str]:
    """A `loom serve --runner pooling` of a tiny embedding model, with the API key."""
    model = make_pooling_model(tmp_path_factory.mktemp("pooling"), "qwen3", "mean_tokens")
    yield from guarded(model, shared_manager, "trio", "--runner", "pooling")


def test_schemathesis_fuzzes_the_pooling_routes(pooling_server, tmp_path):
    doc = httpx.get(f"{pooling_server}/openapi.json").json()
    assert labels(doc) >= POOLING and not labels(doc) & {"POST /v1/completions"}
    report = schemathesis_run(pooling_server, -1, tmp_path)
    assert "10 selected / 10 total" in report
