"""The CPU in one run, one GGUF for every engine: loomllm against llama.cpp and transformers.

Run: `make bench-peers` once (llama.cpp and guidellm), then `loom bench cpu [--model PATH]`;
`make bench-models` writes GGUFs at real shapes. A peer that fails is a row that says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from loomllm.benchmarks import cpu_footprint, int_list, offline_throughput, peers_build, serving
from loomllm.benchmarks.serving import PeerFailed

PROG = "loom bench cpu"
DEFAULT_MODEL = "smollm2"
DEFAULT_LLAMA_BENCH = serving.DEFAULT_LLAMA_SERVER.with_name("llama-bench")
LLAMA_BUILD_RECORD = serving.PEERS / "llama-build.json"


def llama_bench(binary: Path, gguf: Path, prompt: int, output: int) -> tuple[float, float]:
    """llama-bench's (prompt tok/s, generation tok/s) on two threads (nan for a part asked
    with 0 tokens). PeerFailed where it exits with an error or a signal, or prints no
    figures."""
    cmd = [str(binary), "-m", str(gguf), "-t", "2", "-p", str(prompt), "-n", str(output)]
    done = subprocess.run([*cmd, "-o", "json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerFailed("llama-bench", serving.failure_reason(done.returncode, done.stderr))
    try:
        rows = json.loads(done.stdout)
        pp = tg = math.nan
        if prompt:
            pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
        if output:
            tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    except (ValueError, KeyError, StopIteration) as exc:
        reason = f"no figures in its output: {serving.last_line(done.stdout or done.stderr)}"
        raise PeerFailed("llama-bench", reason) from exc
    return pp, tg


def vocab_size(gguf: Path) -> int:
    """The number of tokens in the GGUF's vocabulary, to draw random prompts from."""
    from gguf import GGUFReader

    return len(GGUFReader(gguf).fields["tokenizer.ggml.tokens"].data)


def row(figure: str, ours: float, theirs: float | PeerFailed, peer: str) -> None:
    """One line of the table; a peer that failed is named in its cell, with no ratio."""
    if isinstance(theirs, PeerFailed):
        print(f"| {figure} | {ours:.1f} | {theirs} | — |", flush=True)
        return
    print(f"| {figure} | {ours:.1f} | {theirs:.1f} ({peer}) | {ours / theirs:.2f} |", flush=True)


def compute_dtype() -> str:
    """What dtype="auto" is on this CPU, for transformers to run the same."""
    import torch

    from loomllm.workers.device.dtype import pick_dtype

    return str(pick_dtype("auto", None, torch.device("cpu"))).removeprefix("torch.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a GGUF file every engine runs (default: the embedded SmolLM2-135M-Instruct); the "
        "accuracy part runs on the default only",
    )
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
    p.add_argument("--concurrency", type=int_list, default=[1, 32])
    p.add_argument(
        "--skip",
        type=lambda s: set(s.split(",")),
        default=set(),
        help="parts to leave out: stream,footprint,serving,offline,accuracy (offline holds "
        "transformers' float copy of the model in memory)",
    )
    args = p.parse_args(argv)
    if args.offline_rounds < 1:
        p.error(f"--offline-rounds must be at least 1, got {args.offline_rounds}")

    from loomllm.workers.models.sources import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        p.error(f"--model must be a GGUF file (llama.cpp runs it too), got {args.model!r}")
    for path, what in ((args.llama_bench, "llama-bench"), (args.llama_server, "llama-server")):
        if not path.exists():
            sys.exit(f"no {what} at {path}: run `make bench-peers`")
    if "serving" not in args.skip and not args.guidellm.exists():
        sys.exit(f"no guidellm at {args.guidellm}: run `make bench-peers` (or --skip serving)")
    gguf = Path(source.path)
    is_default = gguf == Path(resolve_model(DEFAULT_MODEL).path)
    dtype = compute_dtype()
    print(
        f"{gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB); llama.cpp -t 2, loomllm torch's "
        f"{os.cpu_count()} cores; loomllm dtype auto ({dtype})"
    )
    print(peers_build.note_for(args.llama_bench, LLAMA_BUILD_RECORD))
    print("\n| figure | loomllm | peer | loomllm / peer |\n|---|---|---|---|", flush=True)

    if "stream" not in args.skip:
        tg: float | PeerFailed
        try:
            _, tg = llama_bench(args.llama_bench, gguf, 128, args.stream_tokens)
        except PeerFailed as exc:
            tg = exc
        prompt = offline_throughput.make_prompts(1, 100, vocab_size(gguf), 0)[0]
        # Five requests, as llama-bench's five runs.
        _, per_token = offline_throughput.single_stream_loomllm(
            prompt, args.stream_tokens, "auto", repeats=5, model=args.model
        )
        row(f"one stream, {args.stream_tokens} tokens, tok/s", 1 / per_token, tg, "llama-bench tg")
        streamed, read_s = cpu_footprint.plain_read(gguf)
        row(
            "one stream, weights read, GB/s",
            streamed / per_token / 1e9,
            streamed / read_s / 1e9,
            "a plain 2-thread read of the same bytes",
        )

    if "footprint" not in args.skip:
        footprint(args, gguf)

    if "serving" not in args.skip:
        options = argparse.Namespace(
            model=args.model,
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
        ours, theirs = served["loomllm"], served["llama.cpp"]
        assert not isinstance(ours, PeerFailed)  # compare raises where loomllm fails
        for i, level in enumerate(args.concurrency):
            failed = isinstance(theirs, PeerFailed)
            tok_s = theirs if failed else theirs[i].output_tok_s
            itl = theirs if failed else theirs[i].itl_p50_ms
            row(f"serving c={level}, output tok/s", ours[i].output_tok_s, tok_s, "llama-server")
            row(
                f"serving c={level}, ITL p50 ms (lower wins)",
                ours[i].itl_p50_ms,
                itl,
                "llama-server",
            )

    if "offline" not in args.skip:
        offline(args, vocab_size(gguf), dtype)

    if "accuracy" not in args.skip:
        if is_default:
            accuracy(args, gguf, dtype)
        else:
            print(f"\naccuracy: skipped, it runs on {DEFAULT_MODEL} (--model {gguf})")


def footprint(args: argparse.Namespace, gguf: Path) -> None:
    """A prompt of 512, load times and worker memory: loomllm's beside llama.cpp's."""
    pp: float | PeerFailed
    rss: float | PeerFailed
    try:
        pp, _ = llama_bench(args.llama_bench, gguf, 512, 0)
    except PeerFailed as exc:
        pp = exc
    try:
        rss = cpu_footprint.llama_bench_peak_rss(args.llama_bench, gguf) / 1e9
    except PeerFailed as exc:
        rss = exc
    ours = cpu_footprint.loomllm_footprint(gguf)
    row(f"prompt of {ours.prompt}, tok/s", ours.prompt_tok_s, pp, f"llama-bench pp{ours.prompt}")
    weights = gguf.stat().st_size
    held = weights + ours.kv_bytes
    row("worker memory, GB (RSS)", ours.rss / 1e9, rss, "llama-bench peak RSS")
    rest = ours.anonymous - ours.kv_bytes  # the interpreter, torch, and the ops' buffers
    print(
        f"\nloomllm's worker: RSS {ours.rss / 1e9:.2f} GB, {ours.rss / held:.2f}x the file "
        f"({weights / 1e9:.2f} GB) and its KV cache ({ours.kv_bytes / 1e9:.2f} GB): the file's "
        f"pages {(ours.rss - ours.anonymous) / 1e9:.2f} GB, the KV cache, and {rest / 1e9:.2f} GB "
        f"more; {ours.shared / 1e9:.2f} GB of the RSS are pages other processes map too (the "
        "imports it inherits from the zygote that forked it, shared libraries). "
        f"Load: {ours.cold_s:.1f} s the first time (the file's config and tokenizer read), "
        f"{ours.warm_s:.1f} s the next (a new worker, which reports {ours.worker_load_s:.2f} s "
        "of its own).",
        flush=True,
    )


def offline(args: argparse.Namespace, vocab: int, dtype: str) -> None:
    """The offline row: loomllm and transformers alternated, each one's median."""
    prompts = offline_throughput.make_prompts(args.offline_prompts, 128, vocab, 0)
    model = offline_throughput.load_hf(dtype, model=args.model)
    rounds: list[tuple[float, float]] = []  # (loomllm, transformers) tok/s
    for _ in range(args.offline_rounds):
        seconds, tokens = offline_throughput.run_loomllm(
            prompts, args.offline_tokens, "auto", model=args.model
        )
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


def accuracy(args: argparse.Namespace, gguf: Path, dtype: str) -> None:
    """Perplexity and KL divergence to the float32 reference, loomllm's and llama.cpp's, as
    `loom bench accuracy` measures them, on the default model; skipped, saying why, where
    llama-perplexity or the reference is missing, or llama.cpp's reference run fails."""
    from loomllm.benchmarks import accuracy as perplexity

    binary = args.llama_bench.with_name("llama-perplexity")
    if not binary.exists():
        print(f"\naccuracy: skipped, no llama-perplexity at {binary}: run `make bench-peers`")
        return
    if not perplexity.DEFAULT_REFERENCE.exists():
        where = perplexity.DEFAULT_REFERENCE
        print(f"\naccuracy: skipped, no float32 reference at {where}: run `make bench-models`")
        return
    print(f"\naccuracy as llama-perplexity measures it, {gguf.name}:")
    # llama.cpp's activations are float32 between its matmuls: loomllm in float32 too.
    dtypes = ("auto",) if dtype == "float32" else ("auto", "float32")
    try:
        perplexity.compare(binary, perplexity.DEFAULT_REFERENCE, [str(gguf)], dtypes=dtypes)
    except PeerFailed as exc:
        print(f"accuracy: skipped, llama.cpp's reference run: {exc}")


if __name__ == "__main__":
    main()
