"""Host values onto the device without waiting for the device's queued work.

A copy from pageable host memory to CUDA first waits for the stream to drain, so a step
whose inputs were copied that way could not be launched while the step before it still
runs (async scheduling). Through pinned memory the copy queues behind that work instead
(PyTorch's caching host allocator keeps the pinned block until the copy is done). On the
CPU these are plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_tensor(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)
