"""Host values onto the device without waiting for the device's queued work.

On the CPU these are plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    # A copy from pageable memory waits for the stream to drain, so the next step could not be
    # launched while the one before still runs (async scheduling). A pinned copy queues behind
    # that work instead; the caching host allocator keeps the pinned block until it is done.
    return tensor.pin_memory().to(device, non_blocking=True)


def device_tensor(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)
