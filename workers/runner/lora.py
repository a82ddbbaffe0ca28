"""LoRA adapters in a step: PEFT checkpoints loaded into max_loras slots, and the model's
linears wrapped so that each packed token adds its own adapter's low-rank update, the tokens
grouped by adapter (a base-model token adds none)."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import torch

from loomllm.protocols.lora import LoRARequest

# The linears an adapter may target: attention's q/k/v/o and the MLP's (transformers' names).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."


class LoRALoadError(ValueError):
    """An adapter this worker cannot run, with why: the request fails alone."""


class LoRALinear(torch.nn.Module):
    """A linear plus each slot's low-rank update B @ A (the scaling folded into B), applied
    to the tokens the step maps to that slot: by the Triton kernel on CUDA (kernels/lora.py),
    else by a torch reference that groups the tokens by adapter."""

    def __init__(self, base: torch.nn.Linear, slots: int, rank: int, step: StepAdapters) -> None:
        super().__init__()
        self.base = base
        dtype, device = base.weight.dtype, base.weight.device
        self.a = torch.zeros(slots, rank, base.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, base.out_features, rank, dtype=dtype, device=device)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if not step.groups:
            return y
        if step.kernel == "triton" or (step.kernel == "auto" and y.is_cuda):
            from loomllm.workers.kernels.lora import add_lora  # Triton: where it runs

            flat = x.reshape(-1, x.shape[-1])
            add_lora(y.view(-1, y.shape[-1]), flat, self.a, self.b, step.token_slots)
            return y
        for slot, rows in step.groups:
            picked = x[..., rows, :]
            y[..., rows, :] += (picked @ self.a[slot].T) @ self.b[slot].T
        return y


class StepAdapters:
    """Which packed tokens of the current step run which slot's adapter: as groups (the
    torch path) and as one slot per token, -1 for none (the Triton kernel)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.token_slots = torch.empty(0, dtype=torch.int32)
        self.kernel = "auto"  # "auto": Triton on CUDA, torch elsewhere; "triton"; "torch"


class LoRAManager:
    """The adapters a worker holds, at most `max_loras`, each of rank <= `max_rank`; the
    least recently used one not needed by a request is replaced by the next one asked for."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.step = StepAdapters()
        self.layers: dict[str, LoRALinear] = {}
        # The kernel reads a power-of-two rank; the ranks past an adapter's own stay zero.
        padded_rank = 1 << (max_rank - 1).bit_length()
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, torch.nn.Linear):
                parent_name, _, child = name.rpartition(".")
                wrapped = LoRALinear(module, max_loras, padded_rank, self.step)
                setattr(model.get_submodule(parent_name), child, wrapped)
                self.layers[name] = wrapped
        if not self.layers:
            raise LoRALoadError(f"the model has none of the linears LoRA targets: {TARGETS}")
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first

    def slot_for(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot holding `lora` (loaded now if it is not); `in_use`: the adapter ids the
        worker's requests hold, which must stay."""
        if lora.lora_int_id in self.slots:
            self.slots.move_to_end(lora.lora_int_id)
            return self.slots[lora.lora_int_id]
        weights = read_peft(Path(lora.lora_path), lora.lora_name, self.max_rank, set(self.layers))
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if free:
            slot = free[0]
        else:
            evictable = [i for i in self.slots if i not in in_use]
            if not evictable:
                raise LoRALoadError(
                    f"LoRA {lora.lora_name!r}: all {self.max_loras} adapter slots are in use"
                )
            slot = self.slots.pop(evictable[0])
        for layer in self.layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()
        try:
            for name, (a, b) in weights.items():
                layer, rank = self.layers[name], a.shape[0]
                layer.a[slot, :rank].copy_(a)
                layer.b[slot, :, :rank].copy_(b)
        except RuntimeError as exc:  # shapes of another model's layers
            raise LoRALoadError(f"LoRA {lora.lora_name!r} does not fit this model: {exc}") from None
        self.slots[lora.lora_int_id] = slot
        return slot

    def set_step(
        self, tokens_by_slot: dict[int, list[int]], num_tokens: int, device: torch.device
    ) -> None:
        """This step's tokens of each slot (packed indices, of `num_tokens`); empty: the base
        model only."""
        self.step.groups = [
            (slot, torch.tensor(rows, dtype=torch.long, device=device))
            for slot, rows in tokens_by_slot.items()
        ]
        slots = [-1] * num_tokens
        for slot, rows in tokens_by_slot.items():
            for row in rows:
                slots[row] = slot
        self.step.token_slots = torch.tensor(slots, dtype=torch.int32, device=device)


def read_peft(
    folder: Path, name: str, max_rank: int, layers: set[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT LoRA checkpoint as {module name: (A [r, in], B scaled [out, r])}; LoRALoadError
    naming the adapter for anything this worker does not run."""
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise LoRALoadError(
            f"LoRA {name!r}: cannot read a PEFT adapter in {folder}: {exc}"
        ) from None
    rank = int(config.get("r", 0))
    if config.get("peft_type", "LORA") != "LORA" or rank < 1:
        raise LoRALoadError(f"LoRA {name!r}: {folder} is not a LoRA adapter")
    if rank > max_rank:
        raise LoRALoadError(f"LoRA {name!r} has rank {rank}, more than max_lora_rank {max_rank}")
    unsupported = [
        key
        for key in (
            "fan_in_fan_out",
            "modules_to_save",
            "use_dora",
            "rank_pattern",
            "alpha_pattern",
        )
        if config.get(key)
    ]
    if config.get("bias", "none") != "none" or unsupported:
        raise LoRALoadError(
            f"LoRA {name!r} uses {unsupported or ['bias']}: loomllm runs plain LoRA on "
            f"{', '.join(TARGETS)}"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise LoRALoadError(f"LoRA {name!r}: unexpected tensor {key}")
        if module not in layers:
            raise LoRALoadError(
                f"LoRA {name!r} adapts {module}: loomllm runs LoRA on {', '.join(TARGETS)}"
            )
        found.setdefault(module, {})[kind[0]] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"LoRA {name!r}: {module} lacks its lora_A or lora_B")
        weights[module] = (pair["A"], pair["B"] * scaling)
    return weights
