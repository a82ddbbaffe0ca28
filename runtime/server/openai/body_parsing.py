"""A request body validated by its model (runtime/server/bodies/); what fails is a 400 that
names the field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from loomllm.server.bodies.body_error import BodyError
from loomllm.server.openai.api_error import ApiError, bad

Body = TypeVar("Body", bound=BaseModel)
MAX_MESSAGE_CHARS = 300  # an error may quote a huge value


def parse(model: type[Body], body: dict[str, Any]) -> Body:
    """`body` as a `model`; a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise as_api_error(exc) from None


def as_api_error(exc: ValidationError) -> ApiError:
    """The first error: `param` is its top-level field, the message its path and reason (a
    BodyError's own, from a model's rule)."""
    error = exc.errors(include_url=False)[0]
    rule = error.get("ctx", {}).get("error")
    if isinstance(rule, BodyError):
        return bad(rule.message[:MAX_MESSAGE_CHARS], rule.param)
    loc = [part for part in error["loc"] if _is_path(part)]
    if not loc:
        return bad(error["msg"][:MAX_MESSAGE_CHARS], None)
    path = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    message = f"{path}: {error['msg']}"
    if error["type"] != "missing":
        message += f", got {error['input']!r}"
    return bad(message[:MAX_MESSAGE_CHARS], str(loc[0]))


def _is_path(part: int | str) -> bool:
    """A location's step into the body, not the name of a union's member pydantic tried
    ("list[str]", "function-after[...]")."""
    return isinstance(part, int) or (
        part.isidentifier() and not part[0].isupper() and part not in _MEMBER_TAGS
    )


_MEMBER_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}
