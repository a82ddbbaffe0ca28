"""A decode step of a GGUF model (SmolLM2-135M unless --model) on the CPU with torch's ops, the
C++ ops layer by layer, and the C++ decoder stack, beside the time of its linear layers alone,
alternated in one process.

Run: `loom bench kernel cpu-step [--model PATH]`. The GGUF runs as stored.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

PROG = "loom bench kernel cpu-step"
MODES = ("torch ops", "C++ ops", "C++ stack")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,64", help="decode rows a step, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="steps timed a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=100, help="each request's prompt tokens")
    p.add_argument("--model", default="smollm2", help="a GGUF file, or the embedded smollm2")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"the ways to run a step, comma-separated: {', '.join(MODES)}",
    )
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(batch_sizes + [args.steps, args.rounds, args.context]) < 1:
        p.error("batch sizes, --steps, --rounds and --context must be >= 1")
    import torch

    from loomllm.workers.device.cpu_features import cpu_supports_bf16
    from loomllm.workers.kernels import cpu_native
    from loomllm.workers.models.cpu_kernels import install_cpu_kernels
    from loomllm.workers.models.loader import load_model

    loaded = load_model(args.model, dtype="auto", device="cpu")
    model = loaded.model
    dtype = getattr(torch, loaded.dtype)
    if not install_cpu_kernels(model, dtype):
        raise SystemExit(f"{PROG}: the C++ ops are unavailable here (see the log)")
    ops = cpu_native.loaded()
    print(
        f"{PROG}: {args.model} as stored, {loaded.dtype} "
        f"({cpu_supports_bf16()[1]}), {torch.get_num_threads()} threads, "
        f"{args.context}-token contexts, median of {args.rounds} rounds of {args.steps} steps"
    )
    print(
        "\n| batch | " + " | ".join(f"{m}, ms" for m in modes) + " | linears alone, ms "
        "| torch ops / C++ stack | C++ stack beyond its linears, ms |"
    )
    print("|---|" + "---|" * (len(modes) + 3))
    for batch in batch_sizes:
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        linears = []
        for _ in range(args.rounds):
            for mode in modes:
                use(model, ops, mode)
                times[mode].append(step_ms(model, loaded.config, dtype, batch, args))
            linears.append(linears_ms(model, dtype, batch, args.steps))
        use(model, ops, "C++ stack")
        median = {mode: statistics.median(t) for mode, t in times.items()}
        alone = statistics.median(linears)
        stack = median.get("C++ stack", math.nan)
        print(
            f"| {batch} | "
            + " | ".join(f"{median[m]:.2f}" for m in modes)
            + f" | {alone:.2f} | x{median.get('torch ops', math.nan) / stack:.2f}"
            + f" | {stack - alone:.2f} |"
        )


def use(model, ops, mode: str) -> None:
    """Run `model` with torch's ops, the C++ ops layer by layer, or the C++ stack."""
    from loomllm.workers.kernels import cpu_native

    model.use_cpu_kernels(None if mode == "torch ops" else ops)
    if mode == "C++ ops":
        model.cpu_stack = None
    cpu_native.use(None if mode == "torch ops" else ops)


def step_ms(model, config, dtype, batch: int, args) -> float:
    """The median ms of a decode step of `batch` requests, after 5 untimed ones."""
    import torch

    from loomllm.core.request import Request
    from loomllm.core.scheduler import Scheduler, SchedulerConfig
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.runner.model_runner import ModelRunner

    block = 16
    per_request = -(-(args.context + args.steps + 8) // block)
    blocks = batch * per_request + 1
    runner = ModelRunner(
        model, config, device=torch.device("cpu"), dtype=dtype, block_size=block, num_blocks=blocks
    )
    scheduler = Scheduler(
        SchedulerConfig(batch, batch * args.context, per_request * block, block, blocks)
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7 + j) % 1000 + 5 for j in range(args.context)]
        scheduler.add_request(Request(f"r{i}", prompt, params, frozenset(), blocks * block, 0.0))
    times = []
    for step in range(args.steps + 6):  # the prompts' step, 5 untimed decodes, then timed ones
        so = scheduler.schedule()
        started = time.perf_counter()
        result = runner.execute(so, step)
        times.append(time.perf_counter() - started)
        scheduler.update_from_output(so, result)
    return statistics.median(times[6:]) * 1e3


def linears_ms(model, dtype, batch: int, steps: int) -> float:
    """The median ms of a step's linear layers alone (each as its forward runs it at `batch`
    rows, the lm_head included), on random inputs."""
    import torch

    layers = [
        m
        for layer in model.model.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ] + [model.lm_head]
    inputs = {m.in_features: torch.randn(1, batch, m.in_features).to(dtype) for m in layers}
    times = []
    with torch.inference_mode():
        for _ in range(steps + 3):
            started = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1e3


if __name__ == "__main__":
    main()
