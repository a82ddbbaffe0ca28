"""Device idle on the CPU: workload (a) against an emulated device that takes a GPU's step time.

Defaults: the 8B shape's kernel times on an H100, behind real host work.
Run: `loom bench engine emulated`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle

from loomllm.benchmarks import run_manager, wait_for_no_workers
from loomllm.benchmarks.gpu_bench import SHAPES, sharegpt_like, submit_all, write_model_dir

# The workers cannot import benchmarks/ from every checkout: send the hooks' code itself.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROG = "loom bench engine emulated"


def install(worker: Any, vocab_size: int, base_ms: float, row_ms: float, token_ms: float) -> None:
    """Give the worker's runner the emulated device (run on the worker: collective_rpc)."""
    import types

    import torch

    from loomllm.workers.device.idle_probe import DeviceIdleProbe

    runner = worker.runner
    launch = runner.launch

    def forward(*, logits_to_keep: torch.Tensor, **_: Any) -> Any:  # [1, kept, V] zeros
        return types.SimpleNamespace(logits=torch.zeros(1, len(logits_to_keep), vocab_size))

    runner.model = forward
    probe = runner.emulated_probe = DeviceIdleProbe(torch.device("cpu"))
    free_at = 0.0  # when the device is done with the steps queued so far
    runner.overlap_launches = True  # as on CUDA: launch the next step before reading this one

    def emulated(so: Any, call_id: int) -> Any:
        nonlocal free_at
        step = launch(so, call_id)
        counts = list(so.num_scheduled_tokens.values())
        if not counts:
            return step
        decode_rows = sum(1 for n in counts if n == 1)
        seconds = (base_ms + row_ms * decode_rows + token_ms * (sum(counts) - decode_rows)) / 1e3
        start = max(time.perf_counter(), free_at)  # queued now, run once the device is free
        end = free_at = start + seconds
        probe.record(start, end, replayed=False, with_prompts=decode_rows < len(counts))

        def wait() -> None:  # the step's tokens are on the host once the device is done
            time.sleep(max(0.0, end - time.perf_counter()))

        step.wait = wait
        return step

    runner.launch = emulated


def device_time(worker: Any) -> Any:
    """The emulated device's DeviceTime since install."""
    return worker.runner.emulated_probe.result()


def run(
    model: str, work: list[tuple[list[int], int]], args: argparse.Namespace, async_scheduling: bool
) -> tuple[float, int, Any, float]:
    """(seconds, output tokens, the device's time (`device_time`), turnaround ms) of one
    engine."""
    import anyio

    from loomllm import Engine, SamplingParams

    async def main() -> tuple[float, int, Any, float]:
        async with Engine(
            model,
            load_format="dummy",
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            max_num_seqs=args.max_num_seqs,
            keep_alive=0,
            kv_cache_memory=args.kv_cache_memory << 20,
            manager_socket=args.manager_socket,
            async_scheduling=async_scheduling,
        ) as engine:
            warm = SamplingParams(max_tokens=2, ignore_eos=True)  # Triton's interpreter
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, warm):
                pass
            await engine.collective_rpc(
                install, SHAPES["tiny"]["vocab_size"], args.base_ms, args.row_ms, args.token_ms
            )
            before = engine.stats().step_timings
            elapsed, tokens = await submit_all(engine, work)
            (device,) = await engine.collective_rpc(device_time)
            timings = engine.stats().step_timings - before
            return elapsed, tokens, device, timings.per_step_ms()["turnaround"]

    return anyio.run(main)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=256,
        help="MiB of KV cache (the "
        "default holds all 256 sequences, as the H100's 26,506 blocks did)",
    )
    p.add_argument("--async-scheduling", choices=["on", "off", "both"], default="on")
    p.add_argument("--rounds", type=int, default=1, help="engines of each mode, alternated")
    p.add_argument("--base-ms", type=float, default=6.76, help="a step's device time at batch 0")
    p.add_argument("--row-ms", type=float, default=0.0231, help="device ms per decode row")
    p.add_argument("--token-ms", type=float, default=0.027, help="device ms per prompt token")
    p.add_argument("--prompt-mean", type=float, default=200)
    p.add_argument("--output-mean", type=float, default=180)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
    # The manager's workers inherit these. The Triton backend on the CPU (the warm-up's
    # forward, before the device is installed) runs in Triton's interpreter. One torch
    # thread, as a GPU worker's host side has: a second one's spinning takes the engine's
    # core and slows the launches being measured.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="loom-emulated-") as tmp, run_manager() as socket:
        args.manager_socket = socket
        model = write_model_dir("tiny", Path(tmp))
        # The 8B shape's workload, lengths and all (drawing ids from another vocabulary
        # draws other lengths), its ids folded into the tiny model's vocabulary. Sampling
        # over that vocabulary is cheaper than over a real one, which a GPU samples anyway.
        vocab = SHAPES["tiny"]["vocab_size"]
        work = [
            ([3 + t % (vocab - 3) for t in prompt], n)
            for prompt, n in sharegpt_like(
                args.num_requests,
                SHAPES["llama-8b"]["vocab_size"],
                args.seed,
                args.prompt_mean,
                args.output_mean,
            )
        ]
        print(
            f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt and "
            f"{sum(n for _, n in work)} output tokens; device step {args.base_ms} ms + "
            f"{args.row_ms} ms a decode row + {args.token_ms} ms a prompt token"
        )
        print(
            "\n| async scheduling | round | seconds | output tok/s | device steps | with "
            "prompts | device busy s | ms a decode-only step | ms a step with prompts | "
            "device idle % | turnaround ms |\n" + "|---" * 11 + "|"
        )
        for round_ in range(1, args.rounds + 1):
            for on in modes:
                wait_for_no_workers(socket)
                seconds, tokens, device, turnaround = run(model, work, args, on)
                print(
                    f"| {'on' if on else 'off'} | {round_} | {seconds:.2f} | "
                    f"{tokens / seconds:.0f} | {device.steps} | {device.prompt_steps} | "
                    f"{device.busy_s:.2f} | "
                    f"{device.decode_only_busy_s * 1e3 / max(device.decode_only_steps, 1):.2f} | "
                    f"{device.prompt_busy_s * 1e3 / max(device.prompt_steps, 1):.2f} | "
                    f"{100 * device.idle_fraction:.1f} | {turnaround:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
