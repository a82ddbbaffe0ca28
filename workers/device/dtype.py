"""The device and dtype a model loads on: the load options ("auto" included) resolved."""

from __future__ import annotations

import logging
from typing import Any

import torch

from loomllm.protocols import choices
from loomllm.workers.device.cpu_features import cpu_supports_bf16

logger = logging.getLogger(__name__)

# The dtypes a model computes in, "auto" resolved (pick_dtype).
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in choices.DTYPES[1:]}


def resolve_device(device: str) -> torch.device:
    """The torch device a `device` load option names ("auto": CUDA where available)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        allowed = "'auto', 'cpu', 'cuda' or 'cuda:N'"
        raise ValueError(f"device must be {allowed}; got {device!r}") from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch_device


def stored_dtype(config: Any) -> str | None:
    """The dtype an HF config says its checkpoint stores, as a name."""
    stored = getattr(config.get_text_config(), "dtype", None)
    return stored if isinstance(stored, str) or stored is None else str(stored).split(".")[-1]


def pick_dtype(dtype: str, stored: str | None, device: torch.device) -> torch.dtype:
    """The dtype a model runs in, from the `dtype` load option and its checkpoint's dtype."""
    if device.type == "cpu" and dtype in ("auto", "bfloat16"):
        is_native, why = cpu_supports_bf16()
        if dtype == "auto":
            # The checkpoint's dtype is ignored because fp16 GEMMs are slow on CPUs; bf16 GEMMs
            # beat fp32 where the CPU computes them natively and lose where they are emulated.
            name = "bfloat16" if is_native else "float32"
            logger.info("dtype auto on CPU: %s, because %s", name, why)
            return DTYPES[name]
        if not is_native:
            logger.warning("bfloat16 on this CPU is slower than float32, because %s", why)
    if dtype != "auto":
        return DTYPES[dtype]
    # Like vLLM: keep a 16-bit checkpoint's dtype, run float32 checkpoints in 16 bits on GPUs.
    if stored in ("float16", "bfloat16"):
        return DTYPES[stored]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
