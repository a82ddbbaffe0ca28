"""The model step: a worker's persistent batch, forward pass, KV cache and CUDA graphs."""
