"""loomllm: an LLM inference runtime. The public names load on first use, so that a
worker importing loomllm.workers never loads the engine, and `import loomllm` stays light.
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
    "LLM": "loomllm.llm",
    "CompletionOutput": "loomllm.outputs",
    "Engine": "loomllm.engine.engine",
    "EngineClosedError": "loomllm.errors",
    "EngineConfig": "loomllm.config",
    "EngineDeadError": "loomllm.errors",
    "EngineStats": "loomllm.metrics.stats",
    "EngineStepError": "loomllm.errors",
    "Logprob": "loomllm.outputs",
    "LoomError": "loomllm.errors",
    "ManagerError": "loomllm.errors",
    "RemoteCallError": "loomllm.errors",
    "RequestMetrics": "loomllm.outputs",
    "RequestOutput": "loomllm.outputs",
    "RequestOutputKind": "loomllm.protocols.sampling",
    "RequestRefusedError": "loomllm.errors",
    "SamplingParams": "loomllm.protocols.sampling",
    "StructuredOutputsParams": "loomllm.protocols.sampling",
    "WorkerStartError": "loomllm.errors",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'loomllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # Later lookups skip this function.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
