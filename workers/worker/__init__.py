"""The worker process: its main loop, its state, its zygote, and its Ray actor."""
