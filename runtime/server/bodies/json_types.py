"""JSON values as a request body reads them: integers within 64 bits (2.0 is 2), finite
numbers, and markers for the limits that only the served model knows (openapi_schemas.py)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field

# Every integer crosses to the workers as msgpack: 64 bits at most.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT_MAX = sys.float_info.max  # a bigger JSON number is no float: 400
# A schema's key naming a limit of the served model that openapi_schemas.py fills in.
LIMIT = "x-loom-limit"
# Strict: a string is never read as a number, nor 1 as true. Fields a body does not know
# are ignored, as OpenAI's clients send fields of newer API versions.
BODY_CONFIG = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


def body_config(**changes: Any) -> ConfigDict:
    """BODY_CONFIG with `changes` (extra fields allowed, a rule for the JSON schema)."""
    return ConfigDict(**{**BODY_CONFIG, **changes})  # type: ignore[typeddict-item]


def _integral(value: Any) -> Any:
    """An integral float as the int it is (JSON has one number type: 2.0 is 2)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def limit(name: str) -> Any:
    """A Field marking its schema with one of openapi_schemas.LIMITS."""
    return Field(json_schema_extra={LIMIT: name})


def json_int(ge: int = INT64_MIN, le: int = INT64_MAX) -> Any:
    """An integer in [ge, le] and 64 bits; an integral float (2.0) is read as its int.

    The bounds come before the validator: after it, pydantic's schema would not state them.
    """
    bounds = Field(ge=max(ge, INT64_MIN), le=min(le, INT64_MAX))
    return Annotated[int, bounds, INTEGRAL]


INTEGRAL = BeforeValidator(_integral)  # after a type's bounds: see json_int
JsonInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]
PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL]
JsonNumber = Annotated[float, Field(ge=-FLOAT_MAX, le=FLOAT_MAX, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL, limit("token_id")]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
