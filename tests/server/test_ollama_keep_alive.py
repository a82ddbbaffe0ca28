"""Ollama's keep_alive values: seconds or Go durations, negative for ever; anything else is
a 400 naming keep_alive."""

from __future__ import annotations

import pytest

from loomllm.server.ollama.keep_alive import keep_alive_seconds
from loomllm.server.openai.api_error import ApiError


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (300, 300.0),
        (2.5, 2.5),
        (-1, -1.0),
        ("0", 0.0),
        ("-1", -1.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("-1m", -60.0),
        ("2h45m30s", 9930.0),
    ],
)
def test_keep_alive_values(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m", "5x", "1h-3m", "nan", True, [5], {}])
def test_bad_keep_alive_is_a_400_naming_it(value):
    with pytest.raises(ApiError) as refused:
        keep_alive_seconds(value)
    assert refused.value.status == 400 and refused.value.param == "keep_alive"
