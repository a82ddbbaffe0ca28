"""EngineConfig: the engine's options, validated once, before anything starts.

Names follow vLLM's engine arguments. Bad values raise ValueError naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocols.messages import WorkerSpec

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
MANAGER_MODES = ("auto", "private")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    # Seconds the workers stay warm after the engine closes; 0: exit with it; -1: pinned.
    keep_alive: float = 300.0
    # "auto": use (or start) the shared per-user daemon; "private": one that dies with us.
    manager: str = "auto"
    manager_socket: Path | None = None  # default: protocols.rundir.default_socket_path()

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty string (a path, hub id or 'smollm2')")
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("manager", self.manager, MANAGER_MODES)
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if not isinstance(self.keep_alive, int | float) or not (
            self.keep_alive >= 0 or self.keep_alive == -1
        ):
            raise ValueError(
                f"keep_alive must be seconds >= 0, or -1 to pin, got {self.keep_alive!r}"
            )

    def worker_spec(self) -> WorkerSpec:
        """What the workers hold; engines with equal specs share warm workers."""
        return WorkerSpec(
            self.model, self.tensor_parallel_size, {"dtype": self.dtype, "device": self.device}
        )


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
