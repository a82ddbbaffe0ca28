"""A request's JSON body: read within a size limit, checked for what JSON allows but a request
never holds (nesting past a depth, lone UTF-16 surrogates); an unread body drained.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from loomllm.server.openai.schemas import ApiError, bad
from loomllm.server.state import server_state

MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt as JSON ids is ~1 MB
DISCARD_BYTES = 64 * 1024 * 1024  # past this an oversized body's connection is just closed
# Deeper bodies are refused: code that walks them (a chat template's copy of the messages)
# recurses, and JSON this deep is never a real request.
MAX_JSON_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # may decode to a lone surrogate


def too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than {max_bytes} bytes",
        None,
        "invalid_request_error",
        "request_too_large",
    )


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, within the server's body limit."""
    return await read_json(request, server_state(request).max_body_bytes)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; over `max_bytes` (declared or streamed): 413.

    An oversized body is still read (not kept) up to DISCARD_BYTES, so that a client still
    sending gets the 413 instead of a connection reset. A declared Content-Type other than
    JSON is a 415 (a browser's cross-site "simple" POST is text/plain); none is taken as JSON.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            if size > DISCARD_BYTES:
                break
            continue
        chunks.append(chunk)
    if size > max_bytes:
        raise too_large(max_bytes)
    content_type = request.headers.get("content-type")
    if content_type and not _is_json_media_type(content_type):
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {content_type!r}"[:300],
            None,
            "invalid_request_error",
            "unsupported_media_type",
        )
    raw = b"".join(chunks)
    try:
        # UTF-8 only (RFC 8259), a byte order mark tolerated; json.loads(bytes) would also
        # take UTF-16 and UTF-32.
        body = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None) from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    _check_json_values(raw, body)
    return body


def _is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _check_json_values(raw: bytes, body: Any) -> None:
    """400 for nesting past MAX_JSON_DEPTH or a string holding a lone UTF-16 surrogate (an
    escape such as \\ud800 unpaired: no text, and the tokenizer refuses it).

    The walk is skipped when the raw bytes show that neither can occur (the usual case).
    """
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    escapes = _SURROGATE_ESCAPE.search(raw) is not None
    if not (deep or escapes):
        return
    # Containers, and strings if they may hold a surrogate; numbers never need a look.
    kinds = (dict, list, str) if escapes else (dict, list)
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise bad(
                    "the request body holds a string with an unpaired UTF-16 surrogate "
                    "escape (\\ud800-\\udfff): not text",
                    None,
                ) from None
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None)
        items = [*value, *value.values()] if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, kinds))


async def drain_body(receive: Any, max_bytes: int) -> None:
    """Read and drop a request's body, up to `max_bytes`: a client that sent it on a kept-alive
    connection can then reuse the connection (an answer before the body makes hypercorn
    close it, racing the client's next request)."""
    seen = 0
    while seen <= max_bytes:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: nothing more to read
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
