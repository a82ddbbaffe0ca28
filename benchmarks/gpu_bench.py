"""GPU benchmark: loomllm vs transformers on random-weight Llama-3.1-8B and Qwen2.5-0.5B shapes.

Workload (a) sent at once; one stream against the bandwidth limit; idle. Run: `loom bench gpu`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from loomllm.benchmarks import run_manager, save_word_tokenizer, wait_for_no_workers

PROG = "loom bench gpu"
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": dict(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "qwen-0.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
}


def shape_config(shape: str) -> Any:
    """The transformers config of `shape`."""
    import transformers

    fields = dict(SHAPES[shape])
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[
        fields.pop("arch")
    ]
    return config_cls(**fields, bos_token_id=1, eos_token_id=2)


def write_model_dir(shape: str, path: Path) -> str:
    """config.json of `shape` and a word-level tokenizer over its vocabulary ("w{i}")."""
    shape_config(shape).save_pretrained(path)
    save_word_tokenizer(path, SHAPES[shape]["vocab_size"])
    return str(path)


def sharegpt_like(
    num: int,
    vocab: int,
    seed: int,
    prompt_mean: float = 200,
    output_mean: float = 180,
    longest: int = 2048,
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: log-normal lengths (sigma 0.8) with these
    means, as ShareGPT's are long-tailed; prompt + output within `longest`."""
    rng = random.Random(seed)

    def draw(mean: float, cap: int) -> int:
        sigma = 0.8
        return max(4, min(cap, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))

    pairs = []
    for _ in range(num):
        prompt_len = draw(prompt_mean, longest // 2)
        pairs.append(
            (
                [rng.randrange(3, vocab) for _ in range(prompt_len)],
                draw(output_mean, longest - prompt_len),
            )
        )
    return pairs


def run_loomllm(
    model: str,
    work: list[tuple[list[int], int]],
    args: argparse.Namespace,
    async_scheduling: bool,
):
    """(seconds, output tokens, the engine's step timings over the run, the device's busy
    and idle time between steps from the worker's DeviceIdleProbe)."""
    import anyio

    from loomllm import Engine, SamplingParams

    async def run() -> tuple[float, int, Any, Any]:
        # Random weights: with ignore_eos their values change no step's cost.
        async with Engine(
            model,
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            keep_alive=0,
            manager_socket=args.manager_socket,
            async_scheduling=async_scheduling,
        ) as engine:
            warm = SamplingParams(max_tokens=4, ignore_eos=True)
            async with engine.generate({"prompt_token_ids": work[0][0]}, warm) as stream:
                async for _ in stream:
                    pass
            stats = engine.stats()
            if async_scheduling:  # once: on CUDA, what the profiling pass left for KV
                print(f"KV cache: {stats.num_total_blocks} blocks", flush=True)
            before = stats.step_timings
            await engine.collective_rpc(lambda worker: worker.runner.start_idle_probe())
            elapsed, tokens = await submit_all(engine, work)
            (device,) = await engine.collective_rpc(lambda w: w.runner.stop_idle_probe())
            return elapsed, tokens, engine.stats().step_timings - before, device

    return anyio.run(run)


async def submit_all(engine: Any, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    """Every request of `work` at once (greedy, `ignore_eos`): (seconds until the last ends,
    output tokens)."""
    import anyio

    from loomllm import SamplingParams

    tokens = 0

    async def one(prompt: list[int], n: int) -> None:
        nonlocal tokens
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        async with engine.generate({"prompt_token_ids": prompt}, params) as stream:
            async for out in stream:
                last = out
        tokens += len(last.outputs[0].token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt, n in work:
            tg.start_soon(one, prompt, n)
    return time.perf_counter() - start, tokens


def run_served(model: str, work: list[tuple[list[int], int]], args: argparse.Namespace):
    """The same requests through `loom serve`, all sent at once (an unlimited request rate):
    (seconds, output tokens from the responses' usage)."""
    import socket
    import subprocess
    import sys

    import anyio
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "loomllm.cli.main",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--load-format",
        "dummy",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--keep-alive",
        "0",
        "--manager-socket",
        str(args.manager_socket),
    ]
    log_path = Path(model) / "serve.log"  # a file, not a pipe: nobody reads it meanwhile
    base = f"http://127.0.0.1:{port}"
    server: subprocess.Popen | None = None

    async def run() -> tuple[float, int]:
        limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=len(work))
        async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:
            with anyio.fail_after(900):
                while True:  # its engine forks a worker and loads the model
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if server is not None and server.poll() is not None:
                        raise RuntimeError(f"loom serve exited: {log_path.read_text()[-2000:]}")
                    await anyio.sleep(0.5)
            tokens = 0

            async def one(prompt: list[int], n: int) -> None:
                nonlocal tokens
                body = {
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": n,
                    "ignore_eos": True,
                    "temperature": 0.0,
                }
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for prompt, n in work:
                    tg.start_soon(one, prompt, n)
            return time.perf_counter() - start, tokens

    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            return anyio.run(run)
        finally:
            server.terminate()
            server.wait(timeout=60)


def single_stream_loomllm(
    model: str, prompt: list[int], n: int, args: argparse.Namespace, enforce_eager: bool
):
    """(decode seconds per token of one request alone, after its first token; the device's
    busy and idle time between the steps of that request, from the worker's probe)."""
    import anyio

    from loomllm import Engine, RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )

    async def run() -> tuple[float, Any]:
        async with Engine(
            model,
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            keep_alive=0,
            manager_socket=args.manager_socket,
            enforce_eager=enforce_eager,
        ) as engine:
            for warm_up in (True, False):
                if not warm_up:
                    await engine.collective_rpc(lambda worker: worker.runner.start_idle_probe())
                first = None
                async with engine.generate({"prompt_token_ids": prompt}, params) as stream:
                    async for _ in stream:
                        first = first or time.perf_counter()
                end = time.perf_counter()
            (device,) = await engine.collective_rpc(lambda w: w.runner.stop_idle_probe())
            return (end - first) / (n - 1), device

    return anyio.run(run)


def workload_ceiling(work: list[tuple[list[int], int]], per_token: float) -> str:
    """What the longest request alone bounds the workload's throughput to: its tokens come
    one step after another, and a step of more requests takes no less time than a step of
    one (the same weights read, and more)."""
    longest = max(n for _, n in work)
    seconds = (longest - 1) * per_token
    tokens = sum(n for _, n in work)
    return (
        f"the workload's longest request decodes {longest} tokens, one step after another: "
        f"at this stream's {per_token * 1e3:.2f} ms a step that is {seconds:.2f} s at "
        f"least, so at most {tokens / seconds:.0f} output tok/s for the {len(work)} "
        f"requests, however they are batched"
    )


def load_hf(model: str, args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(args.device):
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model), dtype=getattr(torch, args.dtype)
        ).eval()


def run_hf_generate(hf, work: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    """Padded batches of `batch` requests in order; each runs to its longest output, and
    only the requested tokens count."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            longest = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in chunk], device=hf.device)
            mask = torch.tensor(
                [[0] * (longest - len(p)) + [1] * len(p) for p, _ in chunk], device=hf.device
            )
            most = max(n for _, n in chunk)
            hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=most,
                min_new_tokens=most,
                pad_token_id=0,
            )
    _sync(hf.device)
    return time.perf_counter() - start, sum(n for _, n in work)


def run_hf_continuous(hf, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    """transformers' continuous batching, each request with its own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in work)
    )
    options = {}
    if hf.device.type == "cpu":
        # transformers sizes its cache by the device's free memory: on a CPU, the host's RAM,
        # gigabytes zeroed, which makes the smoke test slow. Room for every request at once
        # instead; on a GPU, its own sizing, as its users run it.
        from transformers import ContinuousBatchingConfig

        page = ContinuousBatchingConfig().page_size
        blocks = sum(-(-(len(prompt) + n) // page) for prompt, n in work)
        options["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=blocks)
    manager = hf.init_continuous_batching(generation_config=config, **options)
    manager.start()
    try:
        start = time.perf_counter()
        for prompt, n in work:
            manager.add_request(prompt, max_new_tokens=n)
        tokens = 0
        for _ in work:
            result = manager.get_result(timeout=3600)
            if result is None or getattr(result, "error", None):
                raise RuntimeError(f"transformers' continuous batching failed: {result!r}"[:500])
            tokens += len(result.generated_tokens)
        return time.perf_counter() - start, tokens
    finally:
        manager.stop(block=True)


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    import torch

    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def decode_weight_bytes(shape: str, dtype: str) -> int:
    """Bytes one decode step reads: every weight but an untied input embedding (of which a
    step reads one row per request)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shape_config(shape))
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    if not model.config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    return params * element


def _sync(device: Any) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def print_steps(async_on: bool, timings: Any, device: Any) -> None:
    ms = timings.per_step_ms()
    print(
        f"async scheduling {'on' if async_on else 'off'}: {timings.num_steps} engine steps, "
        f"{ms['total']:.2f} ms each, {ms['outside_forward']:.2f} ms of it in the engine "
        f"(schedule, IPC, output; overlapped with the forward when on), "
        f"{ms['turnaround']:.2f} ms from a reply in to the next step out; the device idled "
        f"{100 * device.idle_fraction:.1f}% between steps "
        f"({device.idle_s * 1e3 / max(device.steps - 1, 1):.3f} ms a gap, "
        f"{device.busy_s * 1e3 / max(device.steps, 1):.2f} ms busy a step); "
        f"{device.eager_steps} of {device.steps} steps ran eager, "
        f"{device.eager_busy_s * 1e3 / max(device.eager_steps, 1):.2f} ms each, "
        f"{100 * device.eager_busy_s / max(device.busy_s, 1e-12):.0f}% of the busy time; "
        f"{device.prompt_steps} steps computed prompt tokens, "
        f"{device.prompt_busy_s * 1e3 / max(device.prompt_steps, 1):.2f} ms each, the "
        f"{device.decode_only_steps} decode-only ones "
        f"{device.decode_only_busy_s * 1e3 / max(device.decode_only_steps, 1):.2f} ms each; "
        f"{device.stalls} gaps of 1 ms or more, "
        f"{100 * device.stall_s / max(device.idle_s, 1e-12):.0f}% of the idle time "
        f"(longest {device.longest_gap_s * 1e3:.1f} ms)",
        flush=True,
    )


def row(name: str, seconds: float, tokens: int, ours: float) -> None:
    """One row of the results table."""
    print(
        f"| {name} | {seconds:.1f} | {tokens} | {tokens / seconds:.0f} | "
        f"{ours / (tokens / seconds):.2f} |",
        flush=True,
    )


# stream: one stream with graphs and with enforce_eager; eager: the enforce_eager one alone.
PARTS = ("async-off", "serve", "generate", "continuous", "stream", "eager")


def parts(text: str) -> set[str]:
    """argparse type for a comma-separated subset of PARTS."""
    chosen = {item for item in text.split(",") if item}
    if unknown := chosen - set(PARTS):
        raise argparse.ArgumentTypeError(f"unknown parts {sorted(unknown)}; of {PARTS}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=64, help="requests per padded generate")
    p.add_argument("--prompt-mean", type=float, default=200)
    p.add_argument("--output-mean", type=float, default=180)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        type=parts,
        default=set(),
        help=f"parts not to run, of {','.join(PARTS)} (serve needs starlette and "
        "hypercorn: make gpu-wheels); loomllm with async on always runs: "
        "the ratios' base",
    )
    args = p.parse_args(argv)
    import torch

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory(prefix="loom-gpu-bench-") as tmp, run_manager() as socket:
        args.manager_socket = socket  # every engine of the run, and loom serve's
        model = write_model_dir(args.shape, Path(tmp))
        work = sharegpt_like(
            args.num_requests,
            SHAPES[args.shape]["vocab_size"],
            args.seed,
            args.prompt_mean,
            args.output_mean,
        )
        prompt_tokens = sum(len(p) for p, _ in work)
        print(
            f"{args.shape} on {device_name}, {args.dtype}: {len(work)} requests, "
            f"{prompt_tokens} prompt and {sum(n for _, n in work)} output tokens"
        )
        ours_rows = []
        # Before each part: the last engine's worker gone, and its GPU memory with it.
        settle = functools.partial(wait_for_no_workers, socket)
        for on in (True, False)[: 1 if "async-off" in args.skip else 2]:  # on: the headline
            settle()
            seconds, tokens, timings, device = run_loomllm(model, work, args, on)
            print_steps(on, timings, device)
            name = f"loomllm, async scheduling {'on' if on else 'off'}"
            ours_rows.append((name, seconds, tokens))
        ours = ours_rows[0][2] / ours_rows[0][1]
        # Each row as soon as it is measured: a run cut short by a time limit keeps them.
        print("\n| engine | seconds | output tokens | output tok/s | loomllm / x |")
        print("|---|---|---|---|---|")
        for name, seconds, tokens in ours_rows:
            row(name, seconds, tokens, ours)
        if "serve" not in args.skip:
            settle()
            row("loomllm through loom serve", *run_served(model, work, args), ours)
        if not {"generate", "continuous"} <= args.skip:
            settle()
            hf = load_hf(model, args)
            if "generate" not in args.skip:
                row(
                    f"transformers generate (padded, {args.hf_batch} a batch)",
                    *run_hf_generate(hf, work, args.hf_batch),
                    ours,
                )
            if "continuous" not in args.skip:
                row("transformers continuous batching", *run_hf_continuous(hf, work), ours)
            del hf  # and its cached blocks: the next engine's worker sizes its KV cache
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        print()
        settle()
        bandwidth = copy_bandwidth(args.device)
        limit = bandwidth / decode_weight_bytes(args.shape, args.dtype)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
        # CUDA graphs (on CUDA), then every step eager.
        streams = [] if "stream" in args.skip else [False] + [True] * ("eager" not in args.skip)
        for eager in streams:
            settle()
            per_token, device = single_stream_loomllm(
                model, work[0][0], args.stream_tokens, args, eager
            )
            print(
                f"\none stream{', enforce_eager' if eager else ''}: {1 / per_token:.1f} "
                f"tok/s ({per_token * 1e3:.2f} ms/token); bandwidth limit {limit:.1f} tok/s; "
                f"{100 / per_token / limit:.0f}% of it; the device busy "
                f"{device.busy_s * 1e3 / max(device.steps, 1):.2f} ms a step (the "
                f"prompt's among {device.steps}), idle "
                f"{100 * device.idle_fraction:.1f}% between steps "
                f"({device.idle_s * 1e3 / max(device.steps - 1, 1):.3f} ms a gap, "
                f"{device.stalls} of 1 ms or more)"
            )
            if not eager:
                print(workload_ceiling(work, per_token), flush=True)


if __name__ == "__main__":
    main()
