"""Hostile bodies against /v1/completions and /v1/chat/completions: every one is a 4xx in
OpenAI's error shape, never a 5xx; then the engine is idle, all KV blocks free, and serves.

The field cases come from the served OpenAPI document (every property of both request
schemas gets NaN, infinities, numbers past its bounds and values of the wrong type), the
rest are written by hand: body framing, encodings, sizes, nesting, content types, messages.
A few extreme values that are valid must be answered (200) without harming the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from support.models import TINY_VOCAB
from support.servers import NAME, running

from loomllm.server.bodies.json_types import FLOAT_MAX, INT64_MAX, INT64_MIN
from loomllm.server.request_body import MAX_JSON_DEPTH

pytestmark = pytest.mark.anyio

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"model": NAME, "prompt": "w5 w6", "max_tokens": 2},
    CHAT: {"model": NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2},
}
SCHEMA_NAME = {COMPLETIONS: "CompletionBody", CHAT: "ChatBody"}
COMPONENTS: dict[str, Any] = {}  # the document's schemas, which a "$ref" names
# Fields whose bad values only count next to another field (else the error names that one).
CONTEXT = {
    (CHAT, "top_logprobs"): {"logprobs": True},
    (COMPLETIONS, "stream_options"): {"stream": True},
    (CHAT, "stream_options"): {"stream": True},
}
TEN_MB = 10 * 1024 * 1024
NAN, INF = float("nan"), float("inf")
ANY_PARAM = "<any>"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    path: str
    body: bytes
    status: int = 400
    param: str | None = ANY_PARAM
    content_type: str | None = "application/json"


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()  # allow_nan: NaN and Infinity go out as raw JSON text


def with_field(path: str, name: str, value: Any) -> bytes:
    return dumps({**BASE[path], **CONTEXT.get((path, name), {}), name: value})


def types_of(prop: dict[str, Any]) -> set[str]:
    """The JSON types a property accepts (those of its anyOf members too)."""
    if "$ref" in prop:
        prop = COMPONENTS[prop["$ref"].rsplit("/", 1)[1]]
    kinds = prop.get("type", [])
    found = {kinds} if isinstance(kinds, str) else set(kinds)
    for member in prop.get("anyOf", []):
        found |= types_of(member)
    return found


def out_of_bounds(prop: dict[str, Any]) -> list[Any]:
    """Numbers just past the schema's bounds, and past 64 bits or a float."""
    integer = "integer" in types_of(prop)
    step = 1 if integer else 0.5
    values: list[Any] = [2**63, 2**64, -(2**64), 10**30] if integer else [10**400, -(10**400)]
    if (low := prop.get("minimum")) is not None and low not in (INT64_MIN, -FLOAT_MAX):
        values.append(low - step)
    if (low := prop.get("exclusiveMinimum")) is not None:
        values += [low, low - step]
    if (high := prop.get("maximum")) is not None and high not in (INT64_MAX, FLOAT_MAX):
        values.append(high + step)
    return values


def wrong_types(prop: dict[str, Any]) -> list[Any]:
    kinds = types_of(prop)
    if "number" in kinds:
        kinds.add("integer")
    candidates = {
        "integer": 7,
        "number": 1.5,
        "string": "7",
        "boolean": True,
        "array": [1],
        "object": {"a": 1},
    }
    return [value for kind, value in candidates.items() if kind not in kinds]


def bad_values(prop: dict[str, Any]) -> list[Any]:
    """NaN, infinities, wrong types, out of bounds; for a list, lists of bad items."""
    values = [NAN, INF, -INF, *wrong_types(prop)]
    if types_of(prop) & {"integer", "number"}:
        values += out_of_bounds(prop)
    if "maxLength" in prop:
        values.append("x" * (prop["maxLength"] + 1))
    if prop.get("minLength"):
        values.append("")
    for member in [prop, *prop.get("anyOf", [])]:
        if "items" in member:
            values += [[value] for value in [None, *bad_values(member["items"])]]
    return values


def field_cases(schema: dict[str, Any]) -> list[Case]:
    """Every property of both request schemas but the prompt and messages (by hand below)."""
    COMPONENTS.update(schema)
    cases = []
    for path, schema_name in SCHEMA_NAME.items():
        for name, prop in schema[schema_name]["properties"].items():
            if name in ("prompt", "messages"):
                continue
            if "enum" in prop:  # another model name is a 404; another value of an
                # unsupported field (only its no-op values are listed) a 400
                cases.append(
                    Case(
                        f"{path} {name}=other",
                        path,
                        with_field(path, name, "gpt-9"),
                        404 if name == "model" else 400,
                        name,
                    )
                )
            for value in bad_values(prop):
                label = f"{path} {name}={json.dumps(value)[:24]}"
                cases.append(Case(label, path, with_field(path, name, value), 400, name))
    return cases


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def body_cases() -> list[Case]:
    """What every body route must refuse, whatever its fields: framing, encodings, sizes."""
    cases = []
    for path in SCHEMA_NAME:
        base = json.dumps(BASE[path])
        raw = {
            "empty": b"",
            "spaces": b"   ",
            "null": b"null",
            "list": b"[]",
            "number": b"7",
            "string": b'"w5"',
            "truncated": base[:-1].encode(),
            "trailing": base.encode() + b"x",
            "two objects": base.encode() * 2,
            "single quotes": base.replace('"', "'").encode(),
            "invalid utf-8": b"\xff\xfe" + base.encode(),
            "invalid utf-8 in a string": base.replace("w5", "w5 \udcff").encode(
                "utf-8", "surrogateescape"
            ),
            "lone surrogate escape": base.replace("w5", "w5 \\ud800").encode(),
            "utf-16 body": base.encode("utf-16"),
            "100k nested lists": nested(100_000).encode(),
            "100k nested objects": ('{"a":' * 100_000 + "1" + "}" * 100_000).encode(),
            "nested list field": base.replace(
                '"max_tokens"', f'"x": {nested(100_000)}, "max_tokens"'
            ).encode(),
            "one level too deep": with_field(path, "x", deep_list(MAX_JSON_DEPTH)),
        }
        for label, body in raw.items():
            cases.append(Case(f"{path} {label}", path, body, 400, ANY_PARAM))
        padding = b" " * (TEN_MB - len(base))
        cases.append(Case(f"{path} 10 MB", path, base.encode()[:-1] + padding + b"}", 413, None))
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ):
            cases.append(
                Case(
                    f"{path} content-type {content_type}",
                    path,
                    base.encode(),
                    415,
                    None,
                    content_type,
                )
            )
    return cases


def prompt_cases() -> list[Case]:
    prompts = [
        None,
        "",
        5,
        True,
        {"text": "w5"},
        [],
        [[]],
        [None],
        [-1],
        [256],
        [1.5],
        [2**64],
        ["w5", 5],
        [[5], "w5"],
        [[5, "w5"]],
        [[5, [6]]],
        " ".join(["w5"] * 600),
        NAN,
    ]
    cases = [
        Case(
            f"prompt={json.dumps(p)[:24]}",
            COMPLETIONS,
            with_field(COMPLETIONS, "prompt", p),
            400,
            "prompt",
        )
        for p in prompts
    ]
    for depth, param in ((50, "prompt"), (500, None)):  # past MAX_JSON_DEPTH: the whole body
        deep = with_field(COMPLETIONS, "prompt", "DEEP").replace(b'"DEEP"', nested(depth).encode())
        cases.append(Case(f"prompt {depth} lists deep", COMPLETIONS, deep, 400, param))
    return cases


def message_cases() -> list[Case]:
    def user(**extra: Any) -> dict[str, Any]:
        return {"role": "user", "content": "w5", **extra}

    messages = [
        None,
        [],
        {},
        "w5",
        5,
        [None],
        [5],
        ["w5"],
        [[]],
        [{}],
        [{"role": "user"}],
        [{"content": "w5"}],
        [{"role": None, "content": "w5"}],
        [{"role": "", "content": "w5"}],
        [{"role": 5, "content": "w5"}],
        [{"role": ["user"], "content": "w5"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "w5"}}],
        [{"role": "user", "content": [5]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [user(), None],
        [{"role": "user", "content": " ".join(["w5"] * 600)}],
    ]
    cases = [
        Case(
            f"messages={json.dumps(m)[:40]}", CHAT, with_field(CHAT, "messages", m), 400, "messages"
        )
        for m in messages
    ]
    # Deep enough to break recursive code after parsing (the template's copy of the
    # messages), not the parser: refused for its depth.
    deep = with_field(CHAT, "messages", [user(x="DEEP")]).replace(b'"DEEP"', nested(900).encode())
    cases.append(Case("messages with a 900-deep field", CHAT, deep, 400, ANY_PARAM))
    return cases


# Valid, extreme: answered 200, and the engine lives on. `prompt` fills all but a few
# positions of max_model_len (512) where a huge max_tokens would otherwise run long.
LONG_PROMPT = " ".join(["w5"] * 505)
EXTREME = [
    {"prompt": LONG_PROMPT, "max_tokens": 7},  # to the last token of the context
    {"top_k": INT64_MAX},
    {"top_k": -1},
    {"seed": INT64_MAX},
    {"seed": INT64_MIN},
    {"temperature": FLOAT_MAX},
    {"temperature": 1e-300},
    {"top_p": 1e-300},
    {"min_p": 1.0},
    {"repetition_penalty": FLOAT_MAX},
    {"repetition_penalty": 1e-300},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"stop_token_ids": [TINY_VOCAB - 1, 0], "min_tokens": 2},
    {"logprobs": 20, "n": 3},
    {"n": 128, "max_tokens": 1},
    {"prompt": "w5 \u0000 \U0001f600"},
    {"stop": ["x" * 100_000]},
    {"stop": [f"s{i}" for i in range(1000)]},
    {"min_tokens": 2, "max_tokens": 2, "ignore_eos": False},
    {"unknown_field": {"a": [1]}},
    {"x": deep_list(MAX_JSON_DEPTH - 1)},  # the body is one level more: at the limit
]


def check_error(response: httpx.Response, case: Case) -> str | None:
    """None when the answer is right, else what is wrong with it."""
    if response.status_code != case.status:
        return f"status {response.status_code}, want {case.status}: {response.text[:300]}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {response.text[:300]}"
    if set(error) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(error)}"
    if not (isinstance(error["message"], str) and error["message"]):
        return f"message {error['message']!r}"
    if not isinstance(error["type"], str) or not isinstance(error["code"], str | int | None):
        return f"type {error['type']!r} / code {error['code']!r}"
    if case.param is not ANY_PARAM and error["param"] != case.param:
        return f"param {error['param']!r}, want {case.param!r}: {error['message'][:200]}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"param {error['param']!r}"
    return None


async def post(client: httpx.AsyncClient, case: Case) -> httpx.Response:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    return await client.post(case.path, content=case.body, headers=headers)


async def test_every_bad_body_is_a_4xx_in_openai_shape(chat_model, shared_manager, record_property):
    async with running(chat_model, shared_manager) as (engine, client):
        schema = (await client.get("/openapi.json")).json()["components"]["schemas"]
        cases = field_cases(schema) + body_cases() + prompt_cases() + message_cases()
        failures = []
        for case in cases:
            problem = check_error(await post(client, case), case)
            if problem is not None:
                failures.append(f"{case.name}: {problem}")
        extreme_failures = []
        for extra in EXTREME:
            response = await client.post(COMPLETIONS, json={**BASE[COMPLETIONS], **extra})
            if response.status_code != 200 or not response.json()["choices"]:
                extreme_failures.append(
                    f"{extra!r:.80}: {response.status_code} {response.text[:300]}"
                )
        for huge in (10**9, INT64_MAX):  # past the context: 400 naming max_tokens, as vLLM's
            body = {**BASE[COMPLETIONS], "prompt": LONG_PROMPT, "max_tokens": huge}
            response = await client.post(COMPLETIONS, json=body)
            if response.status_code != 400 or response.json()["error"]["param"] != "max_tokens":
                extreme_failures.append(f"max_tokens {huge}: {response.status_code}")
        with anyio.fail_after(10):
            await engine.wait_until_idle()
        stats = engine.stats()
        ok = await client.post(CHAT, json={**BASE[CHAT], "ignore_eos": True})
    num_5xx = sum(" status 5" in f for f in failures)
    print(
        f"\nbad HTTP input: {len(cases)} cases, {len(failures)} failures ({num_5xx} 5xx); "
        f"{len(EXTREME)} extreme valid bodies, {len(extreme_failures)} failures"
    )
    record_property("bad_input_cases", len(cases))
    record_property("bad_input_failures", len(failures))
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
    assert not extreme_failures, "\n".join(extreme_failures)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
