"""The Triton LoRA kernel (Triton's interpreter on the CPU): each token's own adapter's update,
against a float64 reference, for tokens of several adapters and of none, in the model's dtypes."""

from __future__ import annotations

import pytest
import torch

from loomllm.workers.kernels.lora import add_lora

pytestmark = pytest.mark.compute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_in, n_out, rank", [(64, 96, 8), (100, 48, 4), (32, 130, 16)])
def test_each_token_gets_its_adapters_update(dtype, k_in, n_out, rank):
    torch.manual_seed(0)
    slots_used, tokens = 3, 9
    x = torch.randn(tokens, k_in, dtype=dtype)
    a = torch.randn(slots_used, rank, k_in, dtype=dtype) / k_in**0.5
    b = torch.randn(slots_used, n_out, rank, dtype=dtype)
    slots = torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 2], dtype=torch.int32)
    y = torch.randn(tokens, n_out, dtype=dtype)
    expected = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    add_lora(y, x, a, b, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    assert (y.double() - expected).abs().max().item() <= tolerance * scale
    base = torch.randn(tokens, n_out, dtype=dtype)
    untouched = base.clone()
    add_lora(base, x, a, b, torch.full((tokens,), -1, dtype=torch.int32))
    assert torch.equal(base, untouched)  # no adapter: nothing added


def test_refuses_what_it_does_not_compute():
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="power-of-two rank"):
        add_lora(
            y, x, torch.randn(1, 3, 8), torch.randn(1, 8, 3), torch.zeros(2, dtype=torch.int32)
        )
