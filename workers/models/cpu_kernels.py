"""The CPU's C++ ops (kernels/cpu_native.py) swapped into a model at a worker's start."""

from __future__ import annotations

import logging

import torch

from loomllm.workers.kernels import cpu_native
from loomllm.workers.models.llama.model import LlamaFamilyForCausalLM
from loomllm.workers.models.sources import cache_root

logger = logging.getLogger(__name__)


def install_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Build or load the C++ ops; loomllm's own model then runs its norms, SiLU, rotary
    embedding and cache writes in them, and the torch attention backend its decode rows, for
    any model. False where the ops are unavailable or `dtype` is not one they compute in."""
    if dtype not in cpu_native.DTYPES:
        logger.info(
            "CPU kernels: torch's ops, for %s (the C++ ops compute in %s)",
            dtype,
            ", ".join(str(d).removeprefix("torch.") for d in cpu_native.DTYPES),
        )
        return False
    ops = cpu_native.load(cache_root())
    if ops is None:
        return False
    if isinstance(model, LlamaFamilyForCausalLM):
        norms, layers = model.use_cpu_kernels(ops)
        logger.info("CPU kernels: %d RMSNorm modules, %d decoder layers", norms, layers)
    return True
