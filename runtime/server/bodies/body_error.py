"""BodyError: a rule of a body's model broken; the routes answer it as a 400 naming `param`."""

from __future__ import annotations


class BodyError(ValueError):
    """Raised in a model's validators (pydantic keeps it beside its own errors)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param
