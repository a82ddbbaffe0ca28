"""The errors the server answers in OpenAI's shape: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type_,
            code,
        )

    def body(self) -> dict[str, Any]:
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }
        return {"error": error}


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)
