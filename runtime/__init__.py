"""loomllm's user side: the Engine and its errors. Light to import: no torch here."""

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import (
    EngineClosedError,
    EngineDeadError,
    LoomError,
    ManagerError,
    RemoteCallError,
    WorkerStartError,
)

__all__ = [
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "LoomError",
    "ManagerError",
    "RemoteCallError",
    "WorkerStartError",
]
