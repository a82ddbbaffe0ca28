"""Benchmarks that run loomllm and its peers in one run (`loom bench NAME`)."""

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from loomllm.clients.manager import list_workers, manager_command


def int_list(text: str) -> list[int]:
    """argparse type for "1,8,32"."""
    return [int(item) for item in text.split(",")]


T = TypeVar("T")


def parsed_list(parse: Callable[[str], T], form: str) -> Callable[[str], list[T]]:
    """argparse type for comma-separated items that `parse` reads (tilings, say); a bad
    one is argparse's error, saying the items' `form`."""

    def convert(text: str) -> list[T]:
        try:
            return [parse(item) for item in text.split(",") if item]
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{form}, comma-separated: {exc}") from None

    return convert


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` words, token i being "w{i}", saved to `path`
    beside a random model's config (bos w1, eos w2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "w1",
                "eos_token": "w2",
                "unk_token": "w0",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


@contextlib.contextmanager
def run_manager() -> Iterator[Path]:
    """An engine-manager daemon for one benchmark run, on a socket of its own, stopped (with
    its workers) at the end. Every engine of the run forks its worker from the same warm
    zygote, so the zygote's imports of torch and transformers are paid once, not once an
    engine. Its idle timeout (1 h) outlasts the parts of a run that use no engine
    (transformers' own)."""
    with tempfile.TemporaryDirectory(prefix="loom-bench-", dir="/tmp") as tmp:
        socket = Path(tmp) / "manager.sock"  # /tmp: a Unix socket path is 108 bytes at most
        try:  # `stop` with no daemon running is a no-op
            subprocess.run(
                manager_command(socket, "start", "--idle-timeout", "3600"),
                check=True,
                stdout=subprocess.DEVNULL,
            )
            yield socket
        finally:
            subprocess.run(manager_command(socket, "stop"), check=False, stdout=subprocess.DEVNULL)


def wait_for_no_workers(socket: Path, timeout: float = 120) -> None:
    """Block until the manager at `socket` runs no worker. An engine's exit waits for its
    keep_alive=0 worker to be gone (loomllm.clients.manager.RELEASE_TIMEOUT_S), but `loom
    serve` stopped by a signal, or a release that timed out, may leave one exiting, with
    GPU memory the next worker's KV sizing would count as taken."""
    import anyio

    deadline = time.monotonic() + timeout
    while workers := anyio.run(list_workers, socket):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(workers)} worker(s) still running after {timeout:g} s")
        time.sleep(0.1)
