"""The CPU in one run, one GGUF for every engine: loomllm against llama.cpp and transformers.

Run: `make bench-peers` once (llama.cpp and guidellm), then `loom bench cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from loomllm.benchmarks import int_list, offline_throughput, serving

PROG = "loom bench cpu"
DEFAULT_LLAMA_BENCH = serving.DEFAULT_LLAMA_SERVER.with_name("llama-bench")
SUBJECTS = [
    "the ocean",
    "a violin",
    "the city of Rome",
    "photosynthesis",
    "a mountain bike",
    "the history of tea",
    "volcanoes",
    "a lighthouse",
]
FORMS = [
    "Write a short paragraph about {}.",
    "Here are three facts about {}:",
    "Explain {} to a child.",
    "The most surprising thing about {} is",
]


def llama_bench(binary: Path, gguf: Path, prompt: int, output: int) -> tuple[float, float]:
    """llama-bench's (prompt tok/s, generation tok/s) on two threads."""
    cmd = [str(binary), "-m", str(gguf), "-t", "2", "-p", str(prompt), "-n", str(output)]
    done = subprocess.run([*cmd, "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return pp, tg


def compute_dtype() -> str:
    """What dtype="auto" is on this CPU, for transformers to run the same."""
    import torch

    from loomllm.workers.device.dtype import pick_dtype

    return str(pick_dtype("auto", None, torch.device("cpu"))).removeprefix("torch.")


def accuracy_prompts() -> list[list[int]]:
    from loomllm.text.tokenizer import Tokenizer
    from loomllm.workers.models.sources import prepare_model_dir, resolve_model

    tokenizer = Tokenizer.from_model_dir(str(prepare_model_dir(resolve_model("smollm2"))))
    return [tokenizer.encode(form.format(s)) for s in SUBJECTS for form in FORMS]


def llama_cpp_greedy(
    args: argparse.Namespace,
    prompts: list[list[int]],
    tokens: int,
    workdir: Path,
    extra: Sequence[str] = (),
) -> list[tuple[list[int], list[dict[int, float]]]]:
    """llama-server's greedy tokens for each prompt, and its top logprobs at each step; `extra`
    adds flags to its command."""
    from loomllm.workers.models.sources import resolve_model

    gguf = Path(resolve_model("smollm2").path)
    # One slot, its context long enough for a prompt and its tokens.
    options = argparse.Namespace(
        llama_server=args.llama_server, prompt_tokens=max(map(len, prompts)), output_tokens=tokens
    )
    proc, url, log = serving.serve_llama_cpp(options, gguf, 1, workdir, extra)
    results = []
    try:
        serving.wait_healthy(url, proc, log)
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 0,
                # Both stop at the end of the text: llama.cpp's ignore_eos bans EOS tokens, where
                # vLLM's (and loomllm's) only keeps going past them.
                "n_probs": 5,
                "cache_prompt": False,
                "return_tokens": True,
            }
            answer = httpx.post(f"{url}/completion", json=body, timeout=120).json()
            tops = [
                {top["id"]: top["logprob"] for top in step["top_logprobs"]}
                for step in answer["completion_probabilities"]
            ]
            results.append((answer["tokens"], tops))
    finally:
        serving.stop(proc)
    return results


def loomllm_greedy(prompts: list[list[int]], tokens: int, **options) -> list[list[int]]:
    from loomllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    with LLM("smollm2", **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def agreement(
    ours: list[list[int]], reference: list[tuple[list[int], list[dict[int, float]]]]
) -> tuple[int, list[str]]:
    """(identical outputs, a line for each other one: where it diverges, and llama.cpp's
    logprob gap there between its token and ours, where ours is in its top 5)."""
    identical, notes = 0, []
    for k, (mine, (theirs, tops)) in enumerate(zip(ours, reference, strict=True)):
        if mine == theirs:
            identical += 1
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
            min(len(mine), len(theirs)),
        )
        if at >= min(len(mine), len(theirs)):  # one stopped (EOS) where the other went on
            notes.append(f"prompt {k}: one ends at token {at}, the other goes on")
            continue
        top = tops[at]
        gap = top[theirs[at]] - top[mine[at]] if mine[at] in top else None
        where = f"prompt {k}: diverges at token {at}"
        notes.append(
            f"{where}, logprob gap {gap:.3f}" if gap is not None else f"{where}, ours not in top 5"
        )
    return identical, notes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH)
    p.add_argument("--llama-server", type=Path, default=serving.DEFAULT_LLAMA_SERVER)
    p.add_argument("--guidellm", type=Path, default=serving.DEFAULT_GUIDELLM)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--offline-tokens", type=int, default=128)
    p.add_argument(
        "--offline-rounds",
        type=int,
        default=3,
        help="offline runs of each engine, alternated: the row shows each one's median (the "
        "host drifts between runs a minute apart)",
    )
    p.add_argument("--accuracy-prompts", type=int, default=32)
    p.add_argument("--accuracy-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int_list, default=[1, 32])
    p.add_argument(
        "--skip",
        type=lambda s: set(s.split(",")),
        default=set(),
        help="parts to leave out: stream,serving,offline,accuracy",
    )
    args = p.parse_args(argv)
    if args.offline_rounds < 1:
        p.error(f"--offline-rounds must be at least 1, got {args.offline_rounds}")
    for path, what in ((args.llama_bench, "llama-bench"), (args.llama_server, "llama-server")):
        if not path.exists():
            sys.exit(f"no {what} at {path}: run `make bench-peers`")
    if "serving" not in args.skip and not args.guidellm.exists():
        sys.exit(f"no guidellm at {args.guidellm}: run `make bench-peers` (or --skip serving)")

    from loomllm.workers.models.sources import resolve_model

    gguf = Path(resolve_model("smollm2").path)
    dtype = compute_dtype()
    print(
        f"SmolLM2-135M-Instruct, {gguf.name}; llama.cpp -t 2, loomllm torch's {os.cpu_count()} "
        f"cores; loomllm dtype auto ({dtype})"
    )
    print("\n| figure | loomllm | peer | loomllm / peer |\n|---|---|---|---|", flush=True)

    def row(figure: str, ours: float, theirs: float, peer: str, unit: str = "") -> None:
        print(f"| {figure} | {ours:.1f}{unit} | {theirs:.1f} ({peer}) | {ours / theirs:.2f} |")
        sys.stdout.flush()

    if "stream" not in args.skip:
        pp, tg = llama_bench(args.llama_bench, gguf, 128, args.stream_tokens)
        prompt = offline_throughput.make_prompts(1, 100, 49152, 0)[0]
        # Five requests, as llama-bench's five runs.
        _, per_token = offline_throughput.single_stream_loomllm(
            prompt, args.stream_tokens, "auto", repeats=5
        )
        row(f"one stream, {args.stream_tokens} tokens, tok/s", 1 / per_token, tg, "llama-bench tg")

    if "serving" not in args.skip:
        options = argparse.Namespace(
            prompt_tokens=128,
            output_tokens=64,
            requests=2,
            seed=0,
            dtype="auto",
            loom_args=[],
            llama_server=args.llama_server,
            guidellm=args.guidellm,
            skip_llama_cpp=False,
        )
        served = serving.compare(options, args.concurrency)
        for i, level in enumerate(args.concurrency):
            mine, theirs = served["loomllm"][i], served["llama.cpp"][i]
            row(
                f"serving c={level}, output tok/s",
                mine.output_tok_s,
                theirs.output_tok_s,
                "llama-server",
            )
            row(
                f"serving c={level}, ITL p50 ms (lower wins)",
                mine.itl_p50_ms,
                theirs.itl_p50_ms,
                "llama-server",
            )

    if "offline" not in args.skip:
        prompts = offline_throughput.make_prompts(args.offline_prompts, 128, 49152, 0)
        model = offline_throughput.load_hf(dtype)
        rounds: list[tuple[float, float]] = []  # (loomllm, transformers) tok/s
        for _ in range(args.offline_rounds):
            seconds, tokens = offline_throughput.run_loomllm(prompts, args.offline_tokens, "auto")
            hf_seconds, hf_tokens = offline_throughput.run_hf(model, prompts, args.offline_tokens)
            rounds.append((tokens / seconds, hf_tokens / hf_seconds))
        median_of = "" if len(rounds) == 1 else f" (median of {len(rounds)} alternated runs)"
        row(
            f"offline {args.offline_prompts} x {args.offline_tokens}, tok/s{median_of}",
            statistics.median(ours for ours, _ in rounds),
            statistics.median(theirs for _, theirs in rounds),
            f"transformers generate, {dtype}",
        )
        if len(rounds) > 1:
            each = ", ".join(
                f"{ours:.1f} / {theirs:.1f} = {ours / theirs:.2f}" for ours, theirs in rounds
            )
            print(f"\noffline runs, loomllm / transformers tok/s: {each}", flush=True)

    if "accuracy" not in args.skip:
        workdir = Path(tempfile.mkdtemp(prefix="loom-bench-cpu-"))
        accuracy = accuracy_prompts()[: args.accuracy_prompts]
        try:
            reference = llama_cpp_greedy(args, accuracy, args.accuracy_tokens, workdir)
            # llama.cpp against itself: its decode attention without flash attention (on by
            # default on the CPU) sums in another order and precision. How often that alone
            # changes its greedy text is the floor any other engine can be held to.
            flash_off = llama_cpp_greedy(
                args, accuracy, args.accuracy_tokens, workdir, ("-fa", "off")
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        quantized = loomllm_greedy(accuracy, args.accuracy_tokens)
        runs = [(f"as stored ({dtype})", quantized)]
        if dtype != "float32":  # llama.cpp's activations are float32 between its matmuls
            stored_f32 = loomllm_greedy(accuracy, args.accuracy_tokens, dtype="float32")
            runs.append(("as stored, float32", stored_f32))
        dequantized = loomllm_greedy(
            accuracy, args.accuracy_tokens, dtype="float32", quantization="none"
        )
        runs.append(("dequantized, float32", dequantized))
        n, t = len(accuracy), args.accuracy_tokens
        print(f"\ngreedy agreement with llama-server (temperature 0), {n} prompts x {t} tokens:")
        for name, ours in runs:
            same, notes = agreement(ours, reference)
            print(f"- loomllm {name}: {same} of {n} identical")
            for note in notes:
                print(f"  - {note}")
        same_paths = sum(a == b for a, b in zip(quantized, dequantized, strict=True))
        print(f"- loomllm as stored against dequantized: {same_paths} of {n} identical")
        same, notes = agreement([tokens for tokens, _ in flash_off], reference)
        print(f"- llama-server itself with flash attention off: {same} of {n} identical")
        for note in notes:
            print(f"  - {note}")


if __name__ == "__main__":
    main()
