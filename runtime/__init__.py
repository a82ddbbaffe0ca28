"""loomllm's user side: the Engine and its errors. Light to import: no torch here."""

from protocols.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_stats import EngineStats
from runtime.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineStepError,
    LoomError,
    ManagerError,
    RemoteCallError,
    RequestRefusedError,
    WorkerStartError,
)
from runtime.llm import LLM
from runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "EngineStepError",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoomError",
    "ManagerError",
    "RemoteCallError",
    "RequestRefusedError",
    "WorkerStartError",
]
