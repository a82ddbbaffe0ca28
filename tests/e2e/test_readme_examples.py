"""The README's curl and `openai` examples, pasted as they are against a real `loom serve`.

Each example is the fenced block right after its `<!-- readme-test: NAME -->` marker; only
the port changes. The tiny chat model stands in for SmolLM2 under the same served name.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support.paths import REPO_ROOT
from support.servers import LoomServer, loom_serve

README = REPO_ROOT / "README.md"
README_PORT = "127.0.0.1:8000"


def readme_example(name: str) -> str:
    """The code of the fenced block that follows `<!-- readme-test: name -->` in README.md."""
    readme = README.read_text()
    found = re.findall(rf"<!-- readme-test: {name} -->\n```\w*\n(.*?)\n```\n", readme, re.S)
    assert len(found) == 1, f"README.md needs exactly one block marked readme-test: {name}"
    assert README_PORT in found[0], "the examples talk to loom serve's default address"
    return found[0]


@pytest.fixture(scope="module")
def readme_server(chat_model, shared_manager) -> Iterator[LoomServer]:
    with loom_serve(chat_model, shared_manager.socket, "smollm2") as running:
        yield running


def run_example(readme_server: LoomServer, cmd: list[str], code: str) -> str:
    code = code.replace(README_PORT, f"127.0.0.1:{readme_server.port}")
    result = subprocess.run([*cmd, code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_curl_example(readme_server):
    body = json.loads(run_example(readme_server, ["bash", "-c"], readme_example("curl")))
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert re.fullmatch(r"( ?w\d+)*", choice["message"]["content"])
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 32


def test_readme_openai_example(readme_server):
    out = run_example(readme_server, [sys.executable, "-c"], readme_example("openai"))
    # The tiny model's words; none at all only if it sampled end-of-sequence first.
    assert re.fullmatch(r"( ?w\d+)*\n", out), out
