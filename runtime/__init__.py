"""loomllm's user side: the Engine and its errors. Light to import: no torch here."""

from loomllm.config import EngineConfig
from loomllm.engine.engine import Engine
from loomllm.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineStepError,
    LoomError,
    ManagerError,
    RemoteCallError,
    RequestRefusedError,
    WorkerStartError,
)
from loomllm.llm import LLM
from loomllm.metrics.stats import EngineStats
from loomllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loomllm.protocols.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams

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
