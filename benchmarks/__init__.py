"""Benchmarks that run loomllm and its peers in one run (`loom bench NAME`)."""
