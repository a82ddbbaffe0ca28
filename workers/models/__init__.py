"""Models on a worker: resolving and loading them, their quantization, loomllm's own Llama family."""
