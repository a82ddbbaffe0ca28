"""loomllm's own Llama-family decoder: its config, its modules and its weights."""
