"""User programs with no `if __name__ == "__main__"` guard: as a file, on stdin, as -c.

The module body appends one byte to a counter file, so a re-import of `__main__` (what
multiprocessing's spawn would do) shows as a second byte. Runs on asyncio and trio,
and once more after importing torch and starting threads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUNNERS = {
    "asyncio": "import asyncio\nasyncio.run(main())",
    "trio": "import trio\ntrio.run(main)",
}
TORCH_AND_THREADS = """
import threading, torch
torch.set_num_threads(2)
_ = torch.ones(64, 64) @ torch.ones(64, 64)
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
"""


def user_script(model: str, counter: Path, backend: str, prelude: str = "") -> str:
    return (
        textwrap.dedent(f"""
        import os
        with open({str(counter)!r}, "a") as f:
            f.write("x")
        {textwrap.indent(prelude, "        ").strip()}
        from loomllm import Engine

        async def main():
            async with Engine({model!r}) as engine:
                pids = await engine.collective_rpc(lambda worker: os.getpid())
            print("worker pids", pids)
    """)
        + RUNNERS[backend]
        + "\n"
    )


def run_user_program(how: str, script: str, tmp_path: Path, env: dict[str, str]):
    if how == "file":
        path = tmp_path / "user_script.py"
        path.write_text(script)
        args, stdin = [sys.executable, str(path)], None
    elif how == "stdin":
        args, stdin = [sys.executable, "-"], script
    else:
        args, stdin = [sys.executable, "-c", script], None
    return subprocess.run(args, input=stdin, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_script_without_main_guard(how, backend, tiny_model, shared_manager, tmp_path):
    counter = tmp_path / "count"
    result = run_user_program(
        how, user_script(tiny_model, counter, backend), tmp_path, shared_manager.env
    )
    assert result.returncode == 0, result.stderr
    assert "worker pids [" in result.stdout
    assert counter.read_text() == "x"  # the module body ran exactly once


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_script_that_imported_torch_and_started_threads(
    backend, tiny_model, shared_manager, tmp_path
):
    counter = tmp_path / "count"
    script = user_script(tiny_model, counter, backend, prelude=TORCH_AND_THREADS)
    result = run_user_program("file", script, tmp_path, shared_manager.env)
    assert result.returncode == 0, result.stderr
    assert "worker pids [" in result.stdout
    assert counter.read_text() == "x"
