"""Errors the engine raises to its users."""

from __future__ import annotations

# The exception tree:
# LoomError
# ├── EngineDeadError       a worker died or its connection broke; the engine is done
# ├── EngineClosedError     the engine was used outside its `async with` block
# ├── EngineStepError       the worker raised in a step; those requests fail, others go on
# ├── RequestRefusedError   the workers could not serve one request (also a ValueError)
# ├── ManagerError          the engine-manager could not be reached, started, or refused us
# │   ├── WorkerStartError  the manager could not start workers (bad model, no memory, ...)
# │   └── ModelPullError    the manager could not download a model from the Hub
# └── RemoteCallError       a collective_rpc callable raised on a worker (worker still sound)


class LoomError(Exception):
    """Base of every loomllm runtime error."""


class EngineDeadError(LoomError):
    """The engine lost a worker; `reason` says how (exit code or signal, stderr tail)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineClosedError(LoomError):
    """The engine is not running: enter `async with Engine(...)` first."""


class ManagerError(LoomError):
    """Talking to the engine-manager failed."""


class WorkerStartError(ManagerError):
    """The manager could not start the workers; the message carries the worker's words."""


class ModelPullError(ManagerError):
    """The manager could not download the model from the Hub; the message says why."""


class RemoteCallError(LoomError):
    """A callable sent with collective_rpc raised on a worker."""

    def __init__(self, rank: int, error_type: str, message: str, traceback: str) -> None:
        super().__init__(f"rank {rank}: {error_type}: {message}")
        self.rank = rank
        self.error_type = error_type
        self.remote_traceback = traceback


class RequestRefusedError(LoomError, ValueError):
    """The workers could not serve this request as asked (a grammar that does not compile,
    filters that leave no token): it failed alone, the engine and other requests go on."""


class EngineStepError(LoomError):
    """The worker raised while computing a step: that step's requests fail, the engine lives."""
