"""Worker start: `Engine(...)` to a usable engine, worker forked by the zygote vs a fresh one.

N engines of differing configs, so none finds a warm worker. Run: `loom bench engine worker-start`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from loomllm.benchmarks.engine_overhead import make_tiny_llama
from loomllm.engine.engine import Engine
from loomllm.protocols.sampling import SamplingParams

PROG = "loom bench engine worker-start"
ZYGOTE_WARMUP_S = 15.0  # longer than the zygote's imports take on a 2-core CPU


async def time_engines(model: str, socket: Path, count: int) -> list[float]:
    """Seconds to a usable engine, for `count` engines that each need a new worker."""
    times = []
    for index in range(count):
        started = time.perf_counter()
        # A different max_num_seqs each time: a new worker group, never a warm one.
        async with Engine(
            model, manager_socket=socket, keep_alive=0, max_num_seqs=32 + index
        ) as engine:
            times.append(time.perf_counter() - started)
            async for _ in engine.generate("w5 w6", SamplingParams(max_tokens=1)):
                pass
    return times


def run_side(model: str, count: int, zygote: bool) -> list[float]:
    socket = Path(tempfile.mkdtemp(prefix="loom-bench-", dir="/tmp")) / "m.sock"
    env = {**os.environ, "LOOM_MANAGER_SOCKET": str(socket)}
    env["LOOM_WORKER_ZYGOTE"] = "1" if zygote else "0"
    manager = [sys.executable, "-P", "-m", "loomllm.workers.manager"]
    subprocess.run([*manager, "start"], env=env, check=True, capture_output=True)
    try:
        if zygote:
            # A daemon that is already running has its zygote ready: let this one get there.
            time.sleep(ZYGOTE_WARMUP_S)
        return anyio.run(time_engines, model, socket, count)
    finally:
        subprocess.run([*manager, "stop"], env=env, capture_output=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random llama")
    p.add_argument("--engines", type=int, default=4)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_tiny_llama(Path(tmp))
        fresh = run_side(model, args.engines, zygote=False)
        forked = run_side(model, args.engines, zygote=True)
    print("| worker start | engines | median s | min s | max s |")
    print("|---|---|---|---|---|")
    for name, times in (("fresh interpreter", fresh), ("forked by the zygote", forked)):
        print(
            f"| {name} | {len(times)} | {statistics.median(times):.2f} | "
            f"{min(times):.2f} | {max(times):.2f} |"
        )
    speedup = statistics.median(fresh) / statistics.median(forked)
    print(f"\nzygote speed-up (median): {speedup:.1f}x")


if __name__ == "__main__":
    main()
