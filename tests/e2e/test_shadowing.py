"""An app folder with its own protocols.py, workers/, runtime/ and benchmarks/ packages, and
a torch.py, each raising ImportError: loomllm runs from it, as a script and as `loom serve`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from support.servers import loom_serve

# The app's own modules, named as loomllm's folders once were. torch.py is a name only the
# daemon and the workers import: it fails them if the app's folder is on their sys.path.
SHADOWS = (
    "protocols.py",
    "workers/__init__.py",
    "runtime/__init__.py",
    "benchmarks/__init__.py",
    "torch.py",
)

SCRIPT = """
import asyncio

import trio

from loomllm import Engine, SamplingParams


async def main(backend):
    async with Engine({model!r}, manager="private", dtype="float32") as engine:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        async for out in engine.generate("w5 w6", params):
            pass
    print(backend, "tokens", len(out.outputs[0].token_ids))


asyncio.run(main("asyncio"))
trio.run(main, "trio")
"""


@pytest.fixture
def app_folder(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    for name in SHADOWS:
        path = app / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise ImportError('the app folder\\'s own {name} was imported')\n")
    return app


def test_the_app_folders_own_modules_do_raise(app_folder: Path):
    result = subprocess.run(
        [sys.executable, "-c", "import protocols"], cwd=app_folder, capture_output=True, text=True
    )
    assert "the app folder's own protocols.py was imported" in result.stderr


@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_script_in_an_app_folder_runs_on_asyncio_and_trio(how, app_folder, tiny_model):
    script = textwrap.dedent(SCRIPT.format(model=tiny_model))
    if how == "file":
        (app_folder / "app.py").write_text(script)
        args, stdin = [sys.executable, "app.py"], None
    elif how == "stdin":
        args, stdin = [sys.executable, "-"], script
    else:
        args, stdin = [sys.executable, "-c", script], None
    result = subprocess.run(
        args, input=stdin, cwd=app_folder, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["asyncio tokens 3", "trio tokens 3"]


def test_loom_serve_from_an_app_folder_answers(app_folder, tiny_model, manager):
    # A fresh manager socket: `loom serve` starts the daemon, and so its workers, from here.
    with loom_serve(tiny_model, manager.socket, "tiny", cwd=app_folder) as server:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True}
        answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 3, answer
