"""Engine overhead: steps/s and where each step's time goes, with a model whose forward is ~free.

Run: `loom bench engine overhead` (`--model`: a real model; `--async-scheduling both`: on/off
ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from loomllm.benchmarks import int_list, run_manager, save_word_tokenizer
from loomllm.engine.engine import Engine
from loomllm.metrics.step_timings import PHASES, StepTimings
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams

VOCAB = 256
Row = tuple[int, float, int, StepTimings]  # batch size, seconds, tokens generated, timings

PROG = "loom bench engine overhead"


def make_tiny_llama(path: Path) -> str:
    """A tiny random llama with a word-level tokenizer (token i is "w{i}"), as the tests use."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return str(path)


async def run_batch(
    engine: Engine, batch: int, max_tokens: int, prompt_len: int, seed: int
) -> tuple[float, int, StepTimings]:
    """Run `batch` requests at once; return (seconds, tokens generated, their step timings)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(batch)]
    # What a streaming server asks for: greedy here, so sampling adds nothing to the forward.
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )
    num_tokens = 0

    async def consume(prompt: list[int]) -> None:
        nonlocal num_tokens
        async with engine.generate({"prompt_token_ids": prompt}, params) as stream:
            async for out in stream:
                num_tokens += len(out.outputs[0].token_ids)

    before = engine.stats().step_timings
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(consume, prompt)
    elapsed = time.perf_counter() - start
    return elapsed, num_tokens, engine.stats().step_timings - before


async def run_all(
    model: str, args: argparse.Namespace, async_scheduling: bool, gc_freeze: bool = True
) -> list[Row]:
    options = dict(
        dtype="float32",
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        kv_cache_memory=int(args.kv_cache_memory * 2**30),
        keep_alive=0,
        async_scheduling=async_scheduling,
    )
    rows = []
    async with Engine(model, manager_socket=Path(args.manager_socket), **options) as engine:
        if not gc_freeze:  # undo the heap freeze of the engine's process and the workers'
            gc.unfreeze()
            await engine.collective_rpc(lambda worker: gc.unfreeze())
        await run_batch(engine, max(args.batch_sizes), 8, args.prompt_len, seed=-1)  # warm-up
        for batch in args.batch_sizes:
            rows.append(
                (
                    batch,
                    *await run_batch(engine, batch, args.max_tokens, args.prompt_len, args.seed),
                )
            )
    return rows


def print_table(title: str, rows: list[Row]) -> None:
    print(
        f"\n{title}: ms per step (schedule .. output add up to 'step'; 'loop' is wall "
        "time / steps; 'turnaround': from a reply in to the next step out)"
    )
    head = [
        "batch",
        "steps",
        "steps/s",
        "tok/s",
        *PHASES,
        "step",
        "outside fwd",
        "outside %",
        "loop",
        "turnaround",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for batch, seconds, tokens, t in rows:
        ms = t.per_step_ms()
        cells = [
            str(batch),
            str(t.num_steps),
            f"{t.num_steps / seconds:.0f}",
            f"{tokens / seconds:.0f}",
            *(f"{ms[c]:.3f}" for c in PHASES),
            f"{ms['total']:.3f}",
            f"{ms['outside_forward']:.3f}",
            f"{100 * ms['outside_forward'] / max(ms['total'], 1e-9):.1f}",
            f"{seconds * 1e3 / max(t.num_steps, 1):.3f}",
            f"{ms['turnaround']:.3f}",
        ]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--backends", default="asyncio,trio")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--manager-socket", help="use this running manager instead of one started for the run"
    )
    p.add_argument(
        "--model",
        default=None,
        help="a real model (smollm2, a path) instead of the tiny random llama",
    )
    p.add_argument("--kv-cache-memory", type=float, default=0.0625, help="GiB of KV cache")
    p.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="off",
        help="both: each mode, alternated, and the ratio",
    )
    p.add_argument(
        "--gc-freeze",
        choices=["off", "on", "both"],
        default="on",
        help="off: undo the engine's and the workers' gc.freeze() of their heaps "
        "after the start (runtime/engine/engine.py _freeze_heap); both: the ratio",
    )
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds with 'both'")
    p.add_argument(
        "--worker-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the workers of the manager started for the run (0: leave as is)",
    )
    args = p.parse_args(argv)
    if args.worker_threads:
        # A tiny forward gains nothing from threads, and idle OpenMP threads spinning on a
        # small machine take the cores the engine process needs.
        os.environ["OMP_NUM_THREADS"] = str(args.worker_threads)
    compared = [name for name in ("async_scheduling", "gc_freeze") if getattr(args, name) == "both"]
    if len(compared) > 1:
        p.error("compare one thing at a time: --async-scheduling both or --gc-freeze both")
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="loom-bench-"))
        if not args.manager_socket:  # after OMP_NUM_THREADS is set: its workers inherit it
            args.manager_socket = stack.enter_context(run_manager())
        model = args.model or make_tiny_llama(Path(tmp))
        for backend in args.backends.split(","):
            if not compared:
                run = functools.partial(
                    run_all,
                    model,
                    args,
                    async_scheduling=args.async_scheduling == "on",
                    gc_freeze=args.gc_freeze == "on",
                )
                rows = anyio.run(run, backend=backend)
                print_table(
                    f"backend {backend}, async scheduling {args.async_scheduling}, "
                    f"gc freeze {args.gc_freeze}",
                    rows,
                )
                continue
            what = compared[0].replace("_", " ")
            ratios: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
            for round_ in range(args.rounds):
                tok_s = {}
                for on in (False, True):
                    modes = {
                        name: getattr(args, name) == "on"
                        for name in ("async_scheduling", "gc_freeze")
                    }
                    modes[compared[0]] = on
                    run = functools.partial(run_all, model, args, **modes)
                    rows = anyio.run(run, backend=backend)
                    print_table(
                        f"backend {backend}, {what} {'on' if on else 'off'}, round {round_ + 1}",
                        rows,
                    )
                    tok_s[on] = {batch: tokens / seconds for batch, seconds, tokens, _ in rows}
                for batch in args.batch_sizes:
                    ratios[batch].append(tok_s[True][batch] / tok_s[False][batch])
            print(
                f"\nbackend {backend}: tokens/s with {what} on / off, "
                f"{args.rounds} alternated rounds"
            )
            for batch, r in ratios.items():
                print(
                    f"  batch {batch:3d}: x{statistics.median(r):.3f} "
                    f"(min x{min(r):.3f}, max x{max(r):.3f})"
                )


if __name__ == "__main__":
    main()
