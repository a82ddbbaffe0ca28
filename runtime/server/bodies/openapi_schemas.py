"""The request bodies' JSON schemas for the OpenAPI document, made from their models with the
served model's limits filled in where a body's model marks one (json_types.LIMIT)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from loomllm.protocols.messages import Pooling
from loomllm.server.bodies.json_types import LIMIT
from loomllm.server.bodies.openai_bodies import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
)
from loomllm.server.bodies.pooling_bodies import (
    ClassifyBody,
    EmbeddingBody,
    RerankBody,
    ScoreBody,
)

Schema = dict[str, Any]
REF = "#/components/schemas/{model}"
GENERATION_BODIES: list[type[BaseModel]] = [CompletionBody, ChatBody, TokenizeBody, DetokenizeBody]
POOLING_BODIES: list[type[BaseModel]] = [EmbeddingBody, ClassifyBody, ScoreBody, RerankBody]


def request_schemas(
    bodies: list[type[BaseModel]],
    model: str,
    max_model_len: int,
    vocab_size: int,
    template_names: Collection[str] = (),
    trust_templates: bool = False,
    priority: bool = False,
    pooling: Pooling | None = None,
) -> dict[str, Schema]:
    """Each body's schema and those of the models it holds, by component name (the class's).

    What JSON Schema cannot state (a text prompt's token count, min_tokens <= max_tokens) is
    in the descriptions; the server answers it with a 400.
    """
    _, top = models_json_schema([(body, "validation") for body in bodies], ref_template=REF)
    schemas: dict[str, Schema] = top["$defs"]
    completion = schemas.get(CompletionBody.__name__)
    if completion is not None:
        # Token ids past max_model_len - 1 only when truncate_prompt_tokens cuts them.
        capped = _filled(
            copy.deepcopy(completion["properties"]["prompt"]),
            {"prompt_ids": _cap(max_model_len - 1)},
        )
        truncating = {
            "properties": {"truncate_prompt_tokens": {"type": "integer"}},
            "required": ["truncate_prompt_tokens"],
        }
        completion["allOf"].append({"if": truncating, "else": {"properties": {"prompt": capped}}})
    names = sorted(template_names)
    limits: dict[str, Callable[[Schema], Schema]] = {
        "model": lambda _: {
            "type": ["string", "null"],
            "enum": [model, None],
            "description": "another name: 404",
        },
        "token_id": lambda node: node | {"maximum": vocab_size - 1},
        "token_id_keys": lambda node: _with_keys(node, _ids_below(vocab_size)),
        "context": lambda node: node | {"maximum": max_model_len - 1},
        "prompt_ids": lambda node: node,
        "dimensions": lambda node: node if pooling is None else _dimensions(node, pooling),
        "prompt_text": lambda node: (
            node
            | {
                "description": f"1 to {max_model_len - 1} tokens once encoded "
                "(or truncated: truncate_prompt_tokens)"
            }
        ),
        "messages": lambda node: (
            node
            | {"description": f"rendered by the chat template: 1 to {max_model_len - 1} tokens"}
            if names or trust_templates
            else {"not": {}, "description": "this model has no chat template"}
        ),
        "priority": lambda node: (
            node
            if priority
            else {"enum": [0, None], "description": "only with --scheduling-policy priority"}
        ),
        "chat_template": lambda node: (
            node | {"description": "a template's name, or its text"}
            if trust_templates
            else {
                "enum": names,
                "description": "one of the model's templates; a template's text needs "
                "--trust-request-chat-template",
            }
        ),
    }
    return {name: _nullable(_filled(schema, limits)) for name, schema in schemas.items()}


def _filled(node: Any, limits: dict[str, Callable[[Schema], Schema]]) -> Any:
    """`node` with every schema marked with one of `limits` replaced by that limit's (other
    marks are kept)."""
    if isinstance(node, list):
        return [_filled(item, limits) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _filled(value, limits) for key, value in node.items()}
    if node.get(LIMIT) not in limits:
        return node
    return limits[node.pop(LIMIT)](node)


def _nullable(node: Any) -> Any:
    """`node` with each anyOf of one plain schema and null written as that schema allowing
    null ({"type": ["integer", "null"], ...}): the same, and shorter to read."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    members = node.get("anyOf", [])
    if len(members) != 2 or {"type": "null"} not in members:
        return node
    (other,) = [m for m in members if m != {"type": "null"}]
    if "anyOf" in other or "$ref" in other:
        return node
    merged = {key: value for key, value in node.items() if key != "anyOf"} | other
    if "const" in other:
        merged.pop("type", None)
        merged["enum"] = [merged.pop("const"), None]
    elif "enum" in other:
        merged.pop("type", None)
        merged["enum"] = [*other["enum"], None]
    elif isinstance(other.get("type"), str):
        merged["type"] = [other["type"], "null"]
    else:
        return node
    return merged


def _dimensions(node: Schema, pooling: Pooling) -> Schema:
    """A Matryoshka embedding cuts to any length up to its size; another, to its size only."""
    if pooling.matryoshka:
        return node | {"maximum": pooling.size}
    return {"const": pooling.size, "description": "this model's embeddings cannot be shortened"}


def _cap(most: int) -> Callable[[Schema], Schema]:
    return lambda node: node | {"maxItems": most}


def _with_keys(node: Schema, pattern: str) -> Schema:
    """logit_bias' schema with its keys' pattern (its object member's, in an anyOf)."""
    members = node.get("anyOf", [node])
    for member in members:
        if member.get("type") == "object":
            member["propertyNames"] = {"pattern": pattern}
    return node


def _ids_below(n: int) -> str:
    """A regular expression for the decimal numbers 0 to n - 1 (no leading zeros)."""
    top = str(n - 1)
    options = ["0"] if n > 1 else []
    if len(top) > 1:  # every number with fewer digits than top
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    # Numbers as long as top: top's first i digits, then a smaller digit, then any digits.
    for i, digit in enumerate(top):
        low = "1" if i == 0 else "0"
        if digit > low:
            rest = len(top) - i - 1
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" * (rest > 0)))
    options.append(top)
    # Not "$": in Python's dialect (and tools written in it) "$" also matches before a final
    # newline, which JSON Schema's ECMA-262 does not; this end means the same in both.
    return "^(" + "|".join(dict.fromkeys(options)) + r")(?![\s\S])"
