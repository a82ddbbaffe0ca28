"""Ollama's `keep_alive`: how long a model stays loaded after a request, as seconds (a number)
or a Go duration string ("5m", "1h30m", "0"); negative means until evicted."""

from __future__ import annotations

import re
from typing import Any

from loomllm.server.openai.api_error import bad

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+(?:\.\d*)?|\.\d+)")


def keep_alive_seconds(value: Any) -> float | None:
    """The body's keep_alive in seconds (None when absent; negative: forever), else a 400."""
    if value is None:
        return None
    seconds: float | None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        seconds = float(value)  # Ollama's own CLI sends "-1" and "300" as well
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        seconds = None
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise bad(
            f'keep_alive must be seconds or a duration such as "5m" or "1h30m", got {value!r:.40}',
            "keep_alive",
        )
    return seconds


def _duration(text: str) -> float | None:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if not body:
        return None
    total, at = 0.0, 0
    for match in _PART.finditer(body):
        if match.start() != at:
            return None
        total += float(match.group(1)) * _UNITS[match.group(2)]
        at = match.end()
    return sign * total if at == len(body) else None
