"""The scheduler core: requests, the waiting queue, KV blocks and the scheduler. No I/O."""
