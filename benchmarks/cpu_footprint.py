"""What one GGUF costs besides speed, for `loom bench cpu`: loomllm's load times and worker
memory against llama.cpp's, and the weights' bandwidth at one stream against a plain read.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loomllm.benchmarks import offline_throughput, run_manager, wait_for_no_workers
from loomllm.benchmarks.serving import PeerFailed, failure_reason

# A stored tensor a one-row decode step streams whole: every linear layer's weight (the
# embedding's table too where it is the LM head). One embedding row a token is not counted.
_STREAMED = (".attn_", ".ffn_", "output.weight")


def streamed_tensors(gguf: Path) -> list[str]:
    """The names of the tensors one decode step of one row reads whole."""
    from loomllm.workers.models.gguf_file import GgufFile

    tensors = GgufFile(gguf).tensors
    names = [
        name
        for name, info in tensors.items()
        if len(info.shape) == 2 and any(part in name for part in _STREAMED)
    ]
    if "output.weight" not in tensors:  # the LM head reads the tied embedding
        names.append("token_embd.weight")
    return names


def plain_read(gguf: Path, rounds: int = 5) -> tuple[int, float]:
    """(the bytes a one-row step streams, the seconds a plain read of them takes on this
    process's threads: the best of `rounds`, after one that pages them in)."""

    from loomllm.workers.kernels import cpu_native
    from loomllm.workers.models.gguf_file import GgufFile
    from loomllm.workers.models.sources import cache_root

    ops = cpu_native.load(cache_root())
    if ops is None:
        raise RuntimeError("the C++ ops are unavailable here (see the log)")
    file = GgufFile(gguf)
    tensors = [file.tensor(name) for name in streamed_tensors(gguf)]
    ops.read_bytes(tensors)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        ops.read_bytes(tensors)
        best = min(best, time.perf_counter() - started)
    return sum(t.numel() * t.element_size() for t in tensors), best


def llama_bench_peak_rss(binary: Path, gguf: Path, prompt: int = 512, tokens: int = 128) -> int:
    """llama-bench's peak resident bytes on one run of a prompt and a stream of tokens (the
    kernel's record of the child, as `time -v` reads it). PeerFailed where it fails."""
    cmd = [str(binary), "-m", str(gguf), "-t", "2", "-p", str(prompt), "-n", str(tokens), "-r", "1"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise PeerFailed("llama-bench", failure_reason(proc.returncode, err.read().decode()))
    return usage.ru_maxrss * 1024


@dataclass(frozen=True, slots=True)
class Footprint:
    cold_s: float  # an Engine's start on a file never loaded (its config and tokenizer read)
    warm_s: float  # the next start, a new worker process (the daemon and caches warm)
    worker_load_s: float  # the warm worker's own load, as it reports it
    rss: int  # the worker's resident bytes after prompts of `prompt` and a stream
    anonymous: int  # of them, its memory's (the rest: files' pages, the GGUF's mostly)
    shared: int  # of them, pages other processes map too: the zygote's imports, libraries
    kv_bytes: int  # its KV cache's
    prompt_tok_s: float  # a prompt of `prompt` tokens, alone, computed
    prompt: int


def loomllm_footprint(gguf: Path, prompt: int = 512, tokens: int = 128) -> Footprint:
    """Two starts on a daemon of this run's own, keep_alive 0 so that each start loads the
    model in a new worker: the first after removing what the cache holds for the file."""
    import anyio

    from loomllm import Engine
    from loomllm.clients.manager import list_workers
    from loomllm.workers.models import sources

    shutil.rmtree(sources._converted_dir(gguf), ignore_errors=True)
    # Prompts of their own each (a prompt seen before would be read from the prefix cache).
    prompts = offline_throughput.make_prompts(5, prompt, vocab_of(gguf), 0)

    async def start(
        socket: Path, measure: bool
    ) -> tuple[float, float, tuple[int, int, int], int, float]:
        started = time.perf_counter()
        async with Engine(str(gguf), manager_socket=socket, keep_alive=0) as engine:
            took = time.perf_counter() - started
            info = engine.model_info
            if not measure:
                return took, info.load_seconds, (0, 0, 0), 0, 0.0
            await offline_throughput.stream_timing(engine, prompts[0], 2)  # warm-up
            firsts = [
                (await offline_throughput.stream_timing(engine, p, 2))[0] for p in prompts[1:4]
            ]
            await offline_throughput.stream_timing(engine, prompts[4][:100], tokens)
            workers = await list_workers(socket)
            rss = sum(w.rss_bytes for w in workers)
            anonymous = sum(rollup_bytes(w.pid, "Anonymous") for w in workers)
            shared = sum(rollup_bytes(w.pid, "Shared_Clean", "Shared_Dirty") for w in workers)
            return (
                took,
                info.load_seconds,
                (rss, anonymous, shared),
                kv_cache_bytes(info),
                prompt / statistics.median(firsts),
            )

    with run_manager() as socket:
        wait_for_no_workers(socket)
        cold_s, _, _, _, _ = anyio.run(start, socket, False)
        wait_for_no_workers(socket)
        warm_s, load_s, (rss, anonymous, shared), kv, prompt_tok_s = anyio.run(start, socket, True)
    return Footprint(cold_s, warm_s, load_s, rss, anonymous, shared, kv, prompt_tok_s, prompt)


def rollup_bytes(pid: int, *fields: str) -> int:
    """The sum of a process's `fields` in /proc's smaps_rollup ("Anonymous", "Shared_Dirty"
    ...), in bytes; 0 where it cannot be read."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    total += int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def kv_cache_bytes(info) -> int:
    """The bytes of the KV cache the worker allocated, from READY's facts."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[info.dtype]
    per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * itemsize
    return info.num_kv_blocks * info.block_size * per_token


def vocab_of(gguf: Path) -> int:
    from loomllm.workers.models.gguf_file import GgufFile

    return GgufFile(gguf).tensors["token_embd.weight"].shape[0]
