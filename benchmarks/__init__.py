"""Benchmarks that run loomllm and its peers in one run (`loom bench NAME`)."""


def int_list(text: str) -> list[int]:
    """argparse type for "1,8,32"."""
    return [int(item) for item in text.split(",")]
