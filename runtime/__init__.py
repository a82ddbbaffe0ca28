"""loomllm: an LLM inference runtime; its public names load on first use.

Lazy names keep `import loomllm` light: a worker importing loomllm.workers never loads the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from loomllm.protocols.sampling import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

_MODULES = {
    "loomllm.config": ["EngineConfig"],
    "loomllm.engine.engine": ["Engine"],
    "loomllm.errors": [
        "EngineClosedError",
        "EngineDeadError",
        "EngineStepError",
        "LoomError",
        "ManagerError",
        "RemoteCallError",
        "RequestRefusedError",
        "WorkerStartError",
    ],
    "loomllm.llm": ["LLM"],
    "loomllm.metrics.stats": ["EngineStats"],
    "loomllm.outputs": [
        "ClassificationOutput",
        "ClassificationRequestOutput",
        "CompletionOutput",
        "EmbeddingOutput",
        "EmbeddingRequestOutput",
        "Logprob",
        "RequestMetrics",
        "RequestOutput",
        "ScoringOutput",
        "ScoringRequestOutput",
    ],
    "loomllm.protocols.lora": ["LoRARequest"],
    "loomllm.protocols.sampling": [
        "RequestOutputKind",
        "SamplingParams",
        "StructuredOutputsParams",
    ],
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "LLM",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "EngineStepError",
    "Logprob",
    "LoRARequest",
    "LoomError",
    "ManagerError",
    "RemoteCallError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRefusedError",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "WorkerStartError",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'loomllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # Later lookups skip this function.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
