"""What crosses a process boundary: framing, codec, typed messages. Pure Python, no torch."""
