"""Warm reuse with the real default model: a fresh process attaches to loaded workers fast.

The first program loads SmolLM2 (from the converted-weights cache); the second, a new
interpreter, must reach its first collective_rpc in under a second from entering
`async with`, on the same worker process, with no second load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Processes that need both cores at once: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    import anyio
    from loomllm import Engine

    async def main():
        entered = time.perf_counter()
        async with Engine("smollm2") as engine:
            (pid, loaded_at), = await engine.collective_rpc(lambda w: (os.getpid(), w.loaded_at))
            first_rpc_s = time.perf_counter() - entered
            reused = engine.reused_warm_workers
        print(json.dumps(dict(pid=pid, loaded_at=loaded_at, first_rpc_s=first_rpc_s,
                              reused=reused)))

    anyio.run(main, backend=sys.argv[1])
""")


def run_program(backend: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_engine_in_a_fresh_process_is_warm(manager):
    manager.start()
    first = run_program("asyncio", manager.env)
    assert not first["reused"]
    for backend in ("asyncio", "trio"):
        again = run_program(backend, manager.env)
        assert again["reused"], again
        assert again["pid"] == first["pid"]
        assert again["loaded_at"] == first["loaded_at"]  # the weights were not loaded again
        assert again["first_rpc_s"] < 1.0, again
        print(f"{backend}: cold {first['first_rpc_s']:.2f} s, warm {again['first_rpc_s']:.3f} s")
