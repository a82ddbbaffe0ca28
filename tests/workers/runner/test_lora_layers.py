"""The LoRA layers alone, in-process: the Triton kernel (Triton's interpreter here) and the
torch reference add the same updates to a transformers model's linears, token by token."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.models import make_lora_adapter

from loomllm import LoRARequest
from loomllm.workers.runner.lora import LoRALinear, LoRALoadError, LoRAManager

pytestmark = pytest.mark.compute

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_kernel_and_the_reference_agree_on_a_mixed_step(tiny_model, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    manager = LoRAManager(model, max_loras=2, max_rank=6)  # rank padded to 8 for the kernel
    assert all(isinstance(layer, LoRALinear) for layer in manager.layers.values())
    adapters = [
        LoRARequest("a", 1, make_lora_adapter(tiny_model, tmp_path / "a", 1, ALL, rank=4)),
        LoRARequest("b", 2, make_lora_adapter(tiny_model, tmp_path / "b", 2, ["v_proj"], rank=6)),
    ]
    slots = [manager.slot_for(lora, set()) for lora in adapters]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        manager.set_step({}, 7, torch.device("cpu"))
        base = model(input_ids=ids).logits
        # Tokens 0-2 on a, 3 on the base model, 4-6 on b.
        manager.set_step({slots[0]: [0, 1, 2], slots[1]: [4, 5, 6]}, 7, torch.device("cpu"))
        found = {}
        for kernel in ("torch", "triton"):
            manager.step.kernel = kernel
            found[kernel] = model(input_ids=ids).logits
    assert (found["triton"] - found["torch"]).abs().max().item() < 1e-5
    assert not torch.allclose(found["torch"][0, :3], base[0, :3])  # the adapter binds
    with pytest.raises(LoRALoadError, match="all 2 adapter slots are in use"):
        manager.slot_for(LoRARequest("c", 3, adapters[0].lora_path), {1, 2})
