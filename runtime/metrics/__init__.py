"""The engine's counters, stats snapshots and step timings."""
