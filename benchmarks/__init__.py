"""Benchmarks that run loomllm and its peers in one run (`loom bench NAME`)."""

import json
from pathlib import Path


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
