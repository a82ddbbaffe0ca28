"""Models on a worker: resolving, loading and quantizing them; loomllm's own Llama family."""
