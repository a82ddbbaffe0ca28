"""Host time of an eager decode step: loomllm's own model against transformers' modeling code.

A deep, narrow random Llama on one CPU thread, alternated over rounds.
Run: `loom bench kernel eager-step`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROG = "loom bench kernel eager-step"
IMPLS = ("loom", "transformers")


def step_times(model_dir: str, model_impl: str, batch: int, steps: int) -> float:
    """The median seconds of `steps` decode steps of `batch` requests (after 5 unmeasured)."""
    import torch

    from loomllm.core.request import Request
    from loomllm.core.scheduler import Scheduler, SchedulerConfig
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.models.loader import load_model
    from loomllm.workers.runner.model_runner import ModelRunner

    loaded = load_model(model_dir, dtype="float32", device="cpu", model_impl=model_impl)
    blocks = max(512 // 16, batch * (-(-(steps + 16) // 16)))  # and a whole context
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        num_blocks=blocks,
    )
    # Every prompt (3 tokens) in the first step, whatever the batch.
    scheduler = Scheduler(SchedulerConfig(batch, max(1024, 3 * batch), 512, 16, blocks))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        scheduler.add_request(Request(f"r{i}", [5, 6, 7 + i], params, frozenset(), 512, 0.0))
    times = []
    for step in range(steps + 6):  # the prompts' step, 5 decodes to warm up, then `steps`
        so = scheduler.schedule()
        started = time.perf_counter()
        result = runner.execute(so, step)
        times.append(time.perf_counter() - started)
        scheduler.update_from_output(so, result)
    return statistics.median(times[6:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.batch, args.layers, args.steps, args.rounds) < 1:
        p.error("--batch, --layers, --steps and --rounds must be >= 1")
    import torch
    import transformers

    torch.set_num_threads(1)  # the host's own time, not how well the math spreads
    # The 8B shape's depth at hidden size 64: the math is ~free, so a step is host time.
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    with tempfile.TemporaryDirectory(prefix="loom-eager-step-") as tmp:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp)
        for _ in range(args.rounds):
            for impl in IMPLS:
                times[impl].append(step_times(str(Path(tmp)), impl, args.batch, args.steps))
    print(
        f"{PROG}: {args.layers} layers, batch {args.batch}, CPU, one thread, {args.rounds} rounds"
    )
    for impl in IMPLS:
        print(
            f"model_impl={impl}: " + ", ".join(f"{t * 1e3:.2f}" for t in times[impl]) + " ms a step"
        )
    ratio = statistics.median(times["transformers"]) / statistics.median(times["loom"])
    print(f"transformers / loom, median step: {ratio:.2f}")


if __name__ == "__main__":
    main()
