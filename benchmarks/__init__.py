"""Benchmarks that run loomllm and its peers in one run (`loom bench NAME`)."""

import contextlib
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runtime.manager_client import manager_command


def int_list(text: str) -> list[int]:
    """argparse type for "1,8,32"."""
    return [int(item) for item in text.split(",")]


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` words, token i being "w{i}", saved to `path`
    beside a random model's config (bos w1, eos w2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "w1", "eos_token": "w2", "unk_token": "w0",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip


@contextlib.contextmanager
def run_manager() -> Iterator[Path]:
    """An engine-manager daemon for one benchmark run, on a socket of its own, stopped (with
    its workers) at the end. Every engine of the run forks its worker from the same warm
    zygote: the zygote's imports of torch and transformers, 3 s here and ~15 s on the GPU
    hosts we were lent, are paid once rather than once an engine. With keep_alive=0 an
    engine's exit waits until its worker is gone, so the next one profiles a free GPU."""
    with tempfile.TemporaryDirectory(prefix="loom-bench-", dir="/tmp") as tmp:
        socket = Path(tmp) / "manager.sock"  # /tmp: a Unix socket path is 108 bytes at most
        subprocess.run(manager_command(socket, "start"), check=True, stdout=subprocess.DEVNULL)
        try:
            yield socket
        finally:
            subprocess.run(manager_command(socket, "stop"), check=False, stdout=subprocess.DEVNULL)
