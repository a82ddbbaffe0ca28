"""Linear weights stored in 16 bits under a float32 model (`weight_dtype`), for CPUs.

A small decode batch is bound by reading the weights, so halving their bytes speeds it up.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from loomllm.protocols import choices

logger = logging.getLogger(__name__)

WEIGHT_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in choices.WEIGHT_DTYPES
}
# Up to this many rows a linear layer runs as a 16-bit GEMV/GEMM; above, as a float32 GEMM,
# because larger batches are compute-bound and CPUs without native bf16 emulate 16-bit math.
MAX_HALF_ROWS = 4


class HalfWeightLinear(torch.nn.Module):
    """nn.Linear's forward with a 16-bit weight and float32 inputs and outputs. The cost is
    the weights' rounding to 16 bits (and, for small batches, the inputs'); activations,
    norms, attention and the KV cache stay float32."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= MAX_HALF_ROWS * self.in_features:
            bias = None if self.bias is None else self.bias.to(self.weight.dtype)
            return F.linear(x.to(self.weight.dtype), self.weight, bias).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def store_linear_weights_in(model: torch.nn.Module, weight_dtype: str) -> int:
    """Swap every nn.Linear of a float32 `model` for a HalfWeightLinear; returns how many.

    A weight tied to the input embedding (lm_head) gets its own 16-bit copy: the embedding
    lookup keeps reading float32 rows.
    """
    dtype = WEIGHT_DTYPES[weight_dtype]
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
                setattr(parent, name, HalfWeightLinear(child, dtype))
                swapped += 1
    logger.info("%d linear layers store their weights in %s", swapped, weight_dtype)
    return swapped
