"""LoRARequest: the LoRA adapter a request runs with (vLLM's name and fields), a PEFT
checkpoint's folder; it travels to the workers with the request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients call it (a server's `model`)
    lora_int_id: int  # >= 1, one per adapter: the workers know it by this
    lora_path: str  # the folder of adapter_config.json and adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
