"""CPU workers side by side: a stream's time a token alone and with every engine decoding at
once, the workers' adaptive threads on and off, alternated in one run.

Run: `loom bench kernel cpu-contention`. Each mode gets an engine-manager daemon of its own, whose
workers inherit LOOM_CPU_ADAPTIVE_THREADS from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from contextlib import AsyncExitStack
from pathlib import Path

from loomllm.benchmarks import offline_throughput, run_manager

PROG = "loom bench kernel cpu-contention"
ENV = "LOOM_CPU_ADAPTIVE_THREADS"
MODES = {"on": "1", "off": "0"}


async def stream_ms(engine, prompt: list[int], tokens: int) -> float:
    """Milliseconds a token of one greedy stream, from its first token to its last."""
    return (await offline_throughput.stream_timing(engine, prompt, tokens))[1] * 1e3


async def measure(socket: Path, args: argparse.Namespace) -> tuple[float, list[float]]:
    """(the first engine's ms a token alone, each engine's with all decoding at once)."""
    import anyio

    from loomllm import Engine

    prompt = list(range(100, 100 + args.prompt_tokens))
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                Engine(args.model, manager_socket=socket, dtype=args.dtype)
            )
            for _ in range(args.engines)
        ]
        for engine in engines:  # warm-up
            await stream_ms(engine, prompt[:8], 8)
        alone = await stream_ms(engines[0], prompt, args.tokens)
        together: list[float] = [0.0] * len(engines)

        async def run(i: int) -> None:
            together[i] = await stream_ms(engines[i], prompt, args.tokens)

        async with anyio.create_task_group() as tg:
            for i in range(len(engines)):
                tg.start_soon(run, i)
    return alone, together


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--engines", type=int, default=2, help="engines (and workers) side by side")
    p.add_argument("--tokens", type=int, default=256, help="each stream's tokens")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternated")
    args = p.parse_args(argv)
    if args.engines < 2 or args.tokens < 2 or args.rounds < 1 or args.prompt_tokens < 8:
        p.error("--engines and --tokens must be >= 2, --rounds >= 1, --prompt-tokens >= 8")
    import anyio

    alone: dict[str, list[float]] = {mode: [] for mode in MODES}
    together: dict[str, list[float]] = {mode: [] for mode in MODES}
    before = os.environ.get(ENV)
    try:
        for _ in range(args.rounds):
            for mode, value in MODES.items():
                os.environ[ENV] = value  # the daemon started next, and its workers, see it
                with run_manager() as socket:
                    one, each = anyio.run(measure, socket, args)
                alone[mode].append(one)
                together[mode].extend(each)
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    print(
        f"{PROG}: {args.model} ({args.dtype}), {args.engines} engines, one stream each of "
        f"{args.tokens} tokens after {args.prompt_tokens}; {os.cpu_count()} cores; "
        f"{args.rounds} rounds, medians\n"
    )
    print("| adaptive threads | alone, ms a token | side by side, ms a token (worst) | x alone |")
    print("|---|---|---|---|")
    median = {mode: statistics.median(together[mode]) for mode in MODES}
    for mode in MODES:
        solo = statistics.median(alone[mode])
        print(
            f"| {mode} | {solo:.2f} | {median[mode]:.2f} ({max(together[mode]):.2f}) "
            f"| x{median[mode] / solo:.2f} |"
        )
    print(f"\nside by side, off / on: x{median['off'] / median['on']:.2f}")


if __name__ == "__main__":
    main()
