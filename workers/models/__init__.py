"""Models on a worker: resolving and loading them, and loomllm's own Llama family."""
