"""Where a decode step's device time goes: its kernels, and each matmul's bandwidth alone.

Run: `loom bench kernel decode-profile` on CUDA (`--device cpu`: a smoke test).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loomllm.benchmarks import int_list, parsed_list
from loomllm.benchmarks.gpu_bench import (
    SHAPES,
    copy_bandwidth,
    decode_weight_bytes,
    write_model_dir,
)

PROG = "loom bench kernel decode-profile"
MAX_STEP_TOKENS = 8192  # one step's token budget: the prompts' steps are few
# The skinny kernel's tilings timed by default: its two defaults first, then wider and
# narrower programs, longer and shorter loads, more and fewer of them in flight, and warps.
TILINGS = (
    "16x256x4x4,16x256x3x4,32x256x4x4,32x128x4x4,16x512x3x4,16x128x6x4,64x128x3x4,"
    "16x256x4x2,16x256x4x8"
)
RUNS = ("transformers", "fused", "graphs", "eager")
# A step's kernels by what they do, matched on their names in this order: cuBLAS's GEMMs,
# the paged attention, copies and transposes (a layout a matmul cannot take as it is costs
# one of these a step), loomllm's Triton kernels, and what is left (torch's own).
KERNEL_KINDS = (
    ("GEMM (cuBLAS)", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
    ("attention", re.compile(r"_decode_split_kernel|_prefill_kernel")),
    ("copy or transpose", re.compile(r"copy|transpose|memcpy|memset|cat_|contiguous", re.I)),
    ("loomllm's Triton", re.compile(r"^_\w+_kernel$|^_\w+$")),
)


def matmul_rate(device: str) -> float:
    """bf16 FLOP/s of an 8192-square matrix product on random data, best of 3 (CUDA only)."""
    import torch

    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b  # cuBLAS picks its kernel
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / best


def step_floors(
    shape: str, batch: int, context: int, copy: float, rate: float, prompt_tokens: int = 0
) -> str:
    """What bounds a decode step at `batch` (and `prompt_tokens` of a prompt with it): reading
    every weight and the decodes' K/V bytes at the copy bandwidth, and the matmuls' FLOPs at
    the measured matrix rate (a prompt's attention left out)."""
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    weights = decode_weight_bytes(shape, "bfloat16")
    kv = batch * context * s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * head_dim * 2
    flops = weights * (batch + prompt_tokens)  # 2 FLOPs a bf16 weight (2 bytes) a row
    rows = f" and {prompt_tokens} prompt tokens" if prompt_tokens else ""
    return (
        f"floors at batch {batch}{rows}, ~{context} tokens of context: "
        f"weights {weights / copy * 1e3:.2f}"
        f" ms, their matmuls' FLOPs {flops / rate * 1e3:.2f} ms at {rate / 1e12:.0f} TFLOP/s, "
        f"K/V {kv / copy * 1e3:.2f} ms; max(weights, FLOPs) + K/V = "
        f"{(max(weights / copy, flops / rate) + kv / copy) * 1e3:.2f} ms"
    )


def kernel_kind(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(name):
            return kind
    return "other"


def profile_decode(
    loaded: Any,
    batch_sizes: list[int],
    steps: int,
    warmup: int,
    top: int,
    device: str,
    graphs: bool,
    what: str,
    prompt_len: int,
    floors: Any = None,
    mixed_prompt: int = 0,
) -> None:
    """Profile `steps` decode steps of `loaded` at each batch size, after the prompts' steps
    and `warmup` decode steps; print the wall time a step, the kernels' device time a step
    and the `top` kernels. With `mixed_prompt`, each profiled step also computes a new
    request's prompt of that many tokens, as a serving step that admits one does."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from loomllm.core.request import Request
    from loomllm.core.scheduler import Scheduler, SchedulerConfig
    from loomllm.protocols.sampling import SamplingParams
    from loomllm.workers.runner.model_runner import ModelRunner

    cuda = device.startswith("cuda")
    most = max(batch_sizes)
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        device=torch.device(device),
        dtype=torch.bfloat16,
        block_size=16,
        num_blocks=most * 40,
        attention_backend="triton",
    )
    if graphs:  # else plain eager steps
        runner.enable_graphs(max_num_seqs=most, max_model_len=600, capture=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    for batch in batch_sizes:
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=batch + (steps if mixed_prompt else 0),
                max_num_batched_tokens=MAX_STEP_TOKENS,
                max_model_len=600,
                block_size=16,
                num_blocks=most * 40,
            )
        )
        # The prompts take several steps when they pass one step's token budget; the first
        # ones done decode meanwhile: a token more each, so every request lasts to the end.
        prompt_steps = -(-batch * prompt_len // MAX_STEP_TOKENS)
        params = SamplingParams(
            temperature=0.0, max_tokens=prompt_steps + warmup + steps, ignore_eos=True
        )
        for i in range(batch):
            prompt = [3 + (i + j) % 500 for j in range(prompt_len)]
            scheduler.add_request(Request(f"b{batch}-{i}", prompt, params, frozenset(), 600, 0.0))
        step = functools.partial(_step, scheduler, runner, itertools.count())

        requests = list(scheduler.requests.values())
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
            step()
        for _ in range(warmup):
            step()
        sync()
        first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for k in range(steps):
                if mixed_prompt:  # tokens unlike the decodes' prompts: no prefix shared
                    prompt = [3 + (13 * k + 7 * j) % 500 for j in range(mixed_prompt)]
                    scheduler.add_request(
                        Request(f"b{batch}-m{k}", prompt, first_token, frozenset(), 600, 0.0)
                    )
                step()
            sync()
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name][0] += event.time_range.elapsed_us() / 1e3 / steps
                kernels[event.name][1] += 1 / steps
        busy = sum(ms for ms, _ in kernels.values())
        mixed = f" and a {mixed_prompt}-token prompt" if mixed_prompt else ""
        print(
            f"\nbatch {batch}{mixed}, {what}, {'graphs' if graphs else 'eager'}: {wall_ms:.2f} "
            f"ms a step ({steps} steps, profiled)",
            end="",
        )
        if not cuda:  # no device kernels to list
            print(flush=True)
        else:
            print(f", device kernels {busy:.2f} ms a step, {len(kernels)} distinct kernels")
            print("| kernel | ms/step | launches/step | share |\n|---|---|---|---|")
        for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"| {name[:90]} | {ms:.3f} | {count:.0f} | {100 * ms / busy:.1f}% |", flush=True)
        if cuda:
            print(floors(batch, prompt_len + warmup + steps // 2, prompt_tokens=mixed_prompt))
            kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for name, (ms, count) in kernels.items():
                kinds[kernel_kind(name)][0] += ms
                kinds[kernel_kind(name)][1] += count
            print("\n| kind | ms/step | launches/step |\n|---|---|---|")
            for kind, (ms, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
                print(f"| {kind} | {ms:.3f} | {count:.0f} |", flush=True)
            copies = [
                f"{name[:120]} ({count:.0f} a step)"
                for name, (_, count) in kernels.items()
                if kernel_kind(name) == "copy or transpose"
            ]
            print("copies and transposes: " + ("; ".join(copies) or "none"), flush=True)
        while scheduler.has_unfinished_requests():  # free the slots for the next size
            step()


def _step(scheduler: Any, runner: Any, calls: Iterator[int]) -> None:
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so, next(calls)))


def weight_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """Each distinct [out, in] weight of `shape`'s decoder layers, the packed ones, lm_head."""
    s = SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * (hidden // s["num_attention_heads"])
    return {
        "q": (hidden, hidden),
        "k or v": (kv, hidden),
        "o": (hidden, hidden),
        "gate or up": (inter, hidden),
        "down": (hidden, inter),
        "q|k|v fused": (hidden + 2 * kv, hidden),
        "gate|up fused": (2 * inter, hidden),
        "lm_head": (s["vocab_size"], hidden),
    }


def timer(device: str, reps: int) -> Any:
    """Device seconds of a call: from CUDA graphs of `reps` calls; on the CPU (a smoke test)
    one call's wall time."""
    import time

    from loomllm.workers.kernels import skinny_matmul as skinny

    def wall_seconds(fn: Any) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    if device.startswith("cuda"):
        return functools.partial(skinny.graph_seconds, reps=reps)
    return wall_seconds


def linear_bandwidth(shape: str, batch_sizes: list[int], reps: int, device: str) -> None:
    """Print the bandwidth each of `shape`'s weight matrices reaches as one F.linear (cuBLAS)
    and, at batches skinny_matmul takes, as its Triton kernel (what a worker picks between
    at start). On the CPU a smoke test: one call's wall time each."""
    import torch
    import torch.nn.functional as F

    from loomllm.workers.kernels import skinny_matmul as skinny

    weights = weight_shapes(shape)
    # name -> (cuBLAS's op, the skinny kernel's): the gate|up projection with its SiLU * up.
    ops = {name: (F.linear, skinny.skinny_linear) for name in weights}
    weights["gate|up, SiLU * up"] = weights["gate|up fused"]
    ops["gate|up, SiLU * up"] = (skinny.linear_silu_mul, skinny.skinny_silu_linear)
    seconds = timer(device, reps)
    copy = copy_bandwidth(device)
    print(
        f"\ncopy bandwidth {copy / 1e9:.0f} GB/s (read + write); each matmul alone, GB/s "
        f"of weights read from memory (copies of a weight, in turn, overflow the L2 cache), "
        f"cuBLAS (and up to {skinny.MAX_ROWS} rows: Triton's skinny kernel, and cuBLAS's time / "
        "its); the gate|up projection's row with its activation (cuBLAS then silu_mul's "
        "kernel, and the skinny kernel with it in its epilogue):"
    )
    print(
        "| weight | [out, in] | "
        + " | ".join(f"batch {b}" for b in batch_sizes)
        + " |\n|---|---|"
        + "---|" * len(batch_sizes)
    )
    for name, (out, inp) in weights.items():
        w = torch.randn(out, inp, device=device, dtype=torch.bfloat16)
        theirs, kernel = ops[name]
        cells = []
        for batch in batch_sizes:
            x = torch.randn(batch, inp, device=device, dtype=torch.bfloat16)
            cublas = skinny.matmul_seconds(theirs, x, w, seconds=seconds)
            cell = f"{w.numel() * 2 / cublas / 1e9:.0f}"
            if batch <= skinny.MAX_ROWS:
                ours = skinny.matmul_seconds(kernel, x, w, seconds=seconds)
                cell += f" / {w.numel() * 2 / ours / 1e9:.0f} (x{cublas / ours:.2f})"
            cells.append(cell)
        print(f"| {name} | [{out}, {inp}] | " + " | ".join(cells) + " |", flush=True)


def skinny_tilings(shape: str, tilings: list[Any], reps: int, device: str) -> None:
    """Print the skinny kernel's bandwidth at 1 and MAX_ROWS rows under each tiling, on the
    weights a decode step reads most of: what to set its defaults from (the worker's own
    choice at start is only between cuBLAS and the defaults). A tiling the GPU cannot run
    (too much shared memory, say) shows as "failed"."""
    import torch

    from loomllm.workers.kernels import skinny_matmul as skinny

    shapes = weight_shapes(shape)
    weights = {
        name: (shapes[name], skinny.skinny_linear)
        for name in ("q|k|v fused", "o", "down", "lm_head")
    }
    weights["gate|up, SiLU * up"] = (shapes["gate|up fused"], skinny.skinny_silu_linear)
    seconds = timer(device, reps)
    print(
        f"\nthe skinny kernel's tilings (block_n x block_k x stages x warps; defaults "
        f"{skinny.PLAIN}, gated {skinny.GATED}): GB/s of weights read at 1 / "
        f"{skinny.MAX_ROWS} rows"
    )
    print(
        "| weight | [out, in] | "
        + " | ".join(map(str, tilings))
        + " |\n|---|---|"
        + "---|" * len(tilings)
    )
    for name, ((out, inp), kernel) in weights.items():
        w = torch.randn(out, inp, device=device, dtype=torch.bfloat16)
        cells = []
        for tiling in tilings:
            try:
                rates = []
                for rows in (1, skinny.MAX_ROWS):
                    x = torch.randn(rows, inp, device=device, dtype=torch.bfloat16)
                    call = functools.partial(kernel, tiling=tiling)
                    rates.append(w.numel() * 2 / skinny.matmul_seconds(call, x, w, seconds=seconds))
                cells.append(" / ".join(f"{r / 1e9:.0f}" for r in rates))
            except Exception as exc:  # a tiling this GPU cannot build
                cells.append(f"failed: {type(exc).__name__}")
        print(f"| {name} | [{out}, {inp}] | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    from loomllm.workers.kernels.skinny_matmul import MatmulTiling

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 64])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="decode steps between the prompts' and the profiled ones",
    )
    p.add_argument("--prompt-len", type=int, default=200, help="each request's (max 500)")
    p.add_argument(
        "--runs",
        type=lambda text: [run for run in text.split(",") if run],
        default=list(RUNS),
        help="which steps to profile, comma-separated: transformers (its model and ops), "
        "fused (its model, the fused kernels swapped in), graphs and eager (loomllm's model)",
    )
    p.add_argument(
        "--mixed-prompt",
        type=int,
        default=0,
        help="then profile the steps again, each with a new prompt of this many tokens "
        "(max 599): what a serving step that admits a request costs",
    )
    p.add_argument("--top", type=int, default=12, help="kernels listed per batch size")
    p.add_argument("--reps", type=int, default=50, help="matmuls per timed graph")
    p.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke test (Triton's interpreter, no graphs, no kernel table)",
    )
    p.add_argument(
        "--tilings",
        type=parsed_list(MatmulTiling.parse, "tilings are block_n x block_k x stages [x warps]"),
        default=TILINGS,
        help="the skinny kernel's tilings to time, comma-separated "
        "block_n x block_k x stages x warps (none: '')",
    )
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        p.error("--warmup must be >= 0 and --steps >= 1")
    if not 0 <= args.mixed_prompt < 600:
        p.error("--mixed-prompt must be in [0, 599]: the profile's context is 600 tokens")
    if unknown := sorted(set(args.runs) - set(RUNS)):
        p.error(f"--runs: {', '.join(unknown)} unknown; choose from {', '.join(RUNS)}")
    import torch

    cuda = args.device.startswith("cuda")
    print(f"{PROG}: {args.shape} on {torch.cuda.get_device_name() if cuda else 'cpu'}, bfloat16")
    linear_bandwidth(args.shape, args.batch_sizes, args.reps, args.device)
    if args.tilings:
        skinny_tilings(args.shape, args.tilings, args.reps, args.device)
    from loomllm.workers.models.fused_layers import install_fused_ops
    from loomllm.workers.models.loader import load_model

    profile = functools.partial(
        profile_decode,
        batch_sizes=args.batch_sizes,
        steps=args.steps,
        warmup=args.warmup,
        top=args.top,
        device=args.device,
        prompt_len=args.prompt_len,
        floors=functools.partial(
            step_floors,
            args.shape,
            copy=copy_bandwidth(args.device),
            rate=matmul_rate(args.device) if cuda else 1.0,
        ),
    )
    with tempfile.TemporaryDirectory(prefix="loom-decode-profile-") as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        # Transformers' ops first, then the fused kernels swapped into them (the swap cannot
        # be undone), then loomllm's own model with graphs and eager. On the CPU the
        # kernels run in Triton's interpreter (TRITON_INTERPRET=1).
        load = functools.partial(
            load_model, model_dir, dtype="bfloat16", device=args.device, load_format="dummy"
        )
        if {"transformers", "fused"} & set(args.runs):
            loaded = load(model_impl="transformers")
            if "transformers" in args.runs:
                profile(loaded, graphs=True, what="transformers' ops")
            if "fused" in args.runs:
                install_fused_ops(loaded.model)
                profile(loaded, graphs=True, what="fused ops")
            del loaded  # one model on the device at a time
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if {"graphs", "eager"} & set(args.runs):
            loaded = load(model_impl="loom")
            install_fused_ops(loaded.model)
            for graphs in (True, False):
                if ("graphs" if graphs else "eager") in args.runs:
                    profile(loaded, graphs=graphs, what="loomllm's model")
                    if args.mixed_prompt:
                        profile(
                            loaded,
                            graphs=graphs,
                            what="loomllm's model",
                            mixed_prompt=args.mixed_prompt,
                        )


if __name__ == "__main__":
    main()
