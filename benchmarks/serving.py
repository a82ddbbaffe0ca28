"""Serving in one run: `loom serve` vs llama.cpp's `llama-server` on one GGUF, under guidellm.

Run: `make bench-peers` once (llama-server and guidellm), then `loom bench serving`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from loomllm.benchmarks import int_list

if TYPE_CHECKING:
    from loomllm.workers.models.sources import ModelSource

PROG = "loom bench serving"

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".peers"
DEFAULT_LLAMA_SERVER = PEERS / "llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
DEFAULT_GUIDELLM = PEERS / "guidellm-venv/bin/guidellm"


@dataclass(frozen=True, slots=True)
class Level:
    """guidellm's figures for one server at one concurrency."""

    concurrency: int
    requests: int
    errors: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    ttft_p99_ms: float
    itl_p99_ms: float


class PeerFailed(RuntimeError):
    """A peer that exited with an error or a signal, or gave no figures: "llama-bench failed:
    SIGSEGV (-11): …", one line for a table row."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


def exit_reason(returncode: int) -> str:
    """A process's end in words: the signal that killed it (SIGSEGV (-11)), else its status."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"{signal.Signals(-returncode).name} ({returncode})"
    except ValueError:
        return f"signal {-returncode} ({returncode})"


def last_line(text: str, limit: int = 160) -> str:
    """The last non-empty line of a tool's output, cut to `limit` characters."""
    line = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def failure_reason(returncode: int, output: str) -> str:
    """How a tool ended, and the last line it printed: "SIGSEGV (-11): loading model"."""
    line = last_line(output)
    return f"{exit_reason(returncode)}: {line}" if line else exit_reason(returncode)


def server_exited(proc: subprocess.Popen, log: Path) -> PeerFailed:
    """The error for a server that has exited: its log's end goes to stderr, its exit and
    last line into the message."""
    text = log.read_text(errors="replace")
    print(f"{proc.args[0]} exited; the end of its log:\n{text[-3000:]}", file=sys.stderr)
    return PeerFailed(Path(proc.args[0]).name, failure_reason(proc.returncode, text))


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Block until the server at `url` answers /health; PeerFailed if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise server_exited(proc, log)
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise PeerFailed(Path(proc.args[0]).name, f"not healthy after {timeout} s at {url}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario(url: str, model: str, args: argparse.Namespace, level: int) -> dict:
    """A guidellm scenario: `level` concurrent streams, `requests x level` requests (at
    least 8) so the level reaches its steady state."""
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
                "http2": False,
            },
            "profile": {"kind": "concurrent", "streams": level},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "seed": {"kind": "static", "value": args.seed},
            "constraints": [{"kind": "max_requests", "count": max(8, args.requests * level)}],
        },
    }


def run_guidellm(
    guidellm: Path,
    tokenizer_dir: Path,
    url: str,
    model: str,
    args: argparse.Namespace,
    levels: list[int],
    workdir: Path,
    name: str,
) -> list[Level]:
    """guidellm once per level (each with its own request count), parsed into Levels."""
    results = []
    for level in levels:
        config = workdir / f"{name}-{level}.json"
        config.write_text(json.dumps(scenario(url, model, args, level)))
        report = workdir / f"{name}-{level}-report.json"
        cmd = [
            str(guidellm),
            "run",
            "--config",
            str(config),
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}"
                f"\n{done.stderr[-3000:]}"
            )
        results.append(parse_report(json.loads(report.read_text()), level))
    return results


def parse_report(report: dict, level: int) -> Level:
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def stat(metric: str, key: str) -> float:
        successful = metrics[metric]["successful"]
        if key == "p50":
            return successful["median"]
        return successful["percentiles"][key]

    totals = metrics["request_totals"]
    return Level(
        level,
        totals["successful"],
        totals["errored"],
        metrics["output_tokens_per_second"]["successful"]["mean"],
        stat("time_to_first_token_ms", "p50"),
        stat("inter_token_latency_ms", "p50"),
        stat("time_to_first_token_ms", "p99"),
        stat("inter_token_latency_ms", "p99"),
    )


def serve_loom(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = workdir / "loom-serve.log"
    cmd = [
        str(Path(sys.executable).parent / "loom"),
        "serve",
        args.model,
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--dtype",
        args.dtype,
        *args.loom_args,
    ]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def serve_llama_cpp(
    args: argparse.Namespace, gguf: Path, slots: int, workdir: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = workdir / "llama-server.log"
    ctx = slots * (args.prompt_tokens + args.output_tokens + 64)  # each slot gets ctx / slots
    cmd = [
        str(args.llama_server),
        "-m",
        str(gguf),
        "-t",
        "2",
        "-np",
        str(slots),
        "-c",
        str(ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        "smollm2",
        *extra,
    ]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def print_table(levels: list[int], results: dict[str, list[Level] | PeerFailed]) -> None:
    measured = {name: r for name, r in results.items() if not isinstance(r, PeerFailed)}
    for name, result in results.items():
        if isinstance(result, PeerFailed):
            print(f"\n{name}: {result}")
    print(
        "\n| server | concurrency | requests (errors) | output tok/s | TTFT p50 ms | "
        "ITL p50 ms | TTFT p99 ms | ITL p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, level in enumerate(levels):
        for name, rows in measured.items():
            r = rows[i]
            print(
                f"| {name} | {level} | {r.requests} ({r.errors}) | {r.output_tok_s:.1f} | "
                f"{r.ttft_p50_ms:.0f} | {r.itl_p50_ms:.1f} | {r.ttft_p99_ms:.0f} | "
                f"{r.itl_p99_ms:.1f} |"
            )
    if len(measured) == 2:
        (a, rows_a), (b, rows_b) = measured.items()
        print(f"\n| concurrency | {a} / {b} output tok/s | {a} / {b} ITL p50 (lower is better) |")
        print("|---|---|---|")
        for level, ra, rb in zip(levels, rows_a, rows_b, strict=True):
            print(
                f"| {level} | {ra.output_tok_s / rb.output_tok_s:.2f} | "
                f"{ra.itl_p50_ms / rb.itl_p50_ms:.2f} |"
            )


def tokenizer_dir(source: ModelSource, workdir: Path) -> Path:
    """A folder guidellm loads the tokenizer from. A GGUF's tokenizer is saved alone: the
    model's folder would be its weights dequantized, 32 GB for an 8B file."""
    if source.kind != "gguf":
        return Path(source.path)
    from transformers import AutoTokenizer

    gguf = Path(source.path)
    folder = workdir / "tokenizer"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def measure(
    args: argparse.Namespace,
    name: str,
    server: tuple[subprocess.Popen, str, Path],
    tokenizer: Path,
    levels: list[int],
    workdir: Path,
) -> list[Level]:
    """guidellm's figures for one running server, stopped at the end. PeerFailed where the
    server exits, or no request of a level succeeds."""
    proc, url, log = server
    try:
        wait_healthy(url, proc, log)
        print(f"{name}: serving at {url}; guidellm at concurrency {levels}", file=sys.stderr)
        try:
            results = run_guidellm(
                args.guidellm, tokenizer, url, "smollm2", args, levels, workdir, name
            )
        except RuntimeError as exc:
            if proc.poll() is not None:  # the server died under guidellm's requests
                raise server_exited(proc, log) from exc
            reason = f"against {Path(proc.args[0]).name}: {last_line(str(exc))}"
            raise PeerFailed("guidellm", reason) from exc
        if proc.poll() is not None:
            raise server_exited(proc, log)
    finally:
        stop(proc)
    for level in results:
        if level.requests == 0:
            reason = f"no request succeeded at c={level.concurrency}: {level.errors} errors"
            raise PeerFailed(Path(proc.args[0]).name, reason)
    return results


def compare(args: argparse.Namespace, levels: list[int]) -> dict[str, list[Level] | PeerFailed]:
    """guidellm's figures for `loom serve` on `args.model`, then (unless skipped) llama-server;
    one at a time. A llama-server that fails is its PeerFailed, not an exception."""
    from loomllm.workers.models.sources import resolve_model

    source = resolve_model(args.model)
    results: dict[str, list[Level] | PeerFailed] = {}
    workdir = Path(tempfile.mkdtemp(prefix="loom-bench-serving-"))
    servers = [("loomllm", lambda: serve_loom(args, workdir))]
    if not args.skip_llama_cpp:
        servers.append(
            ("llama.cpp", lambda: serve_llama_cpp(args, Path(source.path), max(levels), workdir))
        )
    # One server at a time: together they would share the same few cores.
    try:
        tokenizer = tokenizer_dir(source, workdir)
        for name, start in servers:
            try:
                results[name] = measure(args, name, start(), tokenizer, levels, workdir)
            except PeerFailed as exc:
                if name == "loomllm":
                    raise
                results[name] = exc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file, or an alias")
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests per level = this x level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--loom-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more `loom serve` flags (last on the line)",
    )
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    p.add_argument("--guidellm", type=Path, default=DEFAULT_GUIDELLM)
    p.add_argument("--skip-llama-cpp", action="store_true")
    args = p.parse_args(argv)
    if not args.guidellm.exists():
        sys.exit(f"no guidellm at {args.guidellm}: run `make bench-peers` (or pass --guidellm)")
    if not args.skip_llama_cpp and not args.llama_server.exists():
        sys.exit(
            f"no llama-server at {args.llama_server}: run `make bench-peers` "
            "(or pass --llama-server, or --skip-llama-cpp)"
        )

    levels = args.concurrency
    results = compare(args, levels)
    print(
        f"prompt {args.prompt_tokens} tokens, output {args.output_tokens} tokens (ignore_eos), "
        f"streaming /v1/completions, guidellm concurrent profile"
    )
    print_table(levels, results)


if __name__ == "__main__":
    main()
