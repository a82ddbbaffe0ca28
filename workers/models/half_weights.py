"""Linear weights stored in 16 bits under a float32 model (`weight_dtype`), for CPUs.

A decode step of a few sequences is bound by reading the weights: storing them in
bfloat16 halves the bytes, and torch's 16-bit GEMV at a handful of rows is as fast per
byte as the float32 one, so one stream decodes ~1.4x faster (benchmarks/RESULTS.md).
Larger batches are bound by the GEMM instead, where 16-bit math is several times slower
than float32 on CPUs without native bf16: those rows upcast the weight and multiply in
float32. Activations, norms, attention and the KV cache stay float32. The cost is the
rounding of weights (and, for small batches, of the activations entering each linear
layer) to 16 bits: measured as greedy agreement and logprob drift against float32.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Up to this many rows a linear layer runs as a 16-bit GEMV/GEMM; above, float32 GEMM.
# Measured on a 2-core AVX2 CPU: 16-bit is on par with float32 at 1-4 rows and 2.5-4.5x
# slower from 8 rows on, where float32 GEMM is compute-bound and 16-bit is emulated.
MAX_HALF_ROWS = 4


class HalfWeightLinear(torch.nn.Module):
    """nn.Linear's forward with a 16-bit weight and float32 inputs and outputs."""

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
