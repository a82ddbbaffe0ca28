"""The pieces every part of the OpenAPI document is made of: a schema reference, an object's
schema, and an operation with the error answers it may give."""

from __future__ import annotations

from typing import Any

from loomllm.server.bodies.openapi_schemas import Schema

EXAMPLE_TEXT = "Say this is a test"  # OpenAI's own example prompt


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def object_of(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


ERRORS = {
    "400": "invalid request: the message names the field (param)",
    "401": "missing or wrong API key",
    "404": "no such model",
    "413": "request body too large",
    "415": "Content-Type other than application/json",
    "500": "the engine failed this request",
    "503": "the engine is restarting or the server is shutting down",
}


def operation(
    summary: str, request: str | None, ok: Schema, statuses: list[str], example: Any = None
) -> Schema:
    error = {"content": {"application/json": {"schema": ref("Error")}}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    responses |= {s: {"description": ERRORS[s], **error} for s in statuses}
    operation: Schema = {"summary": summary, "responses": responses}
    if request is not None:
        media = {"schema": ref(request), "example": example}
        operation["requestBody"] = {"required": True, "content": {"application/json": media}}
    return operation


def json_(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}
