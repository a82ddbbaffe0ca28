"""OpenAI tool calling on chat completions: the tools reach the model's chat template.

A call `tool_choice` demands ("required" or a named function) is generated under a JSON schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loomllm.protocols.sampling import StructuredOutputsParams
from loomllm.server.bodies.chat_fields import Tool, ToolsBody
from loomllm.server.openai.api_error import bad
from loomllm.server.parsers.tool_parsers import call_id

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """A chat request's demanded tool calls."""

    function: str | None  # the function tool_choice names; None: "required", any of them
    constraint: StructuredOutputsParams

    def finish(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for calls the model made under "required";
        a forced (named) call keeps the engine's ("stop", or "length" if cut short)."""
        if self.function is None and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """An answer's calls, as `message.tool_calls`. A named function's arguments are the
        text as generated, whole or cut short; "required" calls need the whole JSON array
        to be split (None when max_tokens or a stop string cut it)."""
        if self.function is not None:
            pairs = [(self.function, text)]
        else:
            try:
                value = json.loads(text)
                pairs = [
                    (v["name"], json.dumps(v["parameters"], ensure_ascii=False, allow_nan=False))
                    for v in value
                ]
            except (ValueError, TypeError, KeyError, RecursionError):
                return None  # not the whole array (RecursionError: nested past json's depth)
        return [
            {"id": call_id(), "type": "function", "function": {"name": name, "arguments": a}}
            for name, a in pairs
        ]


def parse_tools(
    body: ToolsBody, auto: bool = False
) -> tuple[list[dict[str, Any]] | None, ToolCalls | None, bool]:
    """The tools for the chat template (None: none), the calls tool_choice demands, and
    whether the answer is read for calls the model chose to make ("auto": only when the
    server has a parser of the model's tool-call syntax, `auto`).

    Without such a parser "auto" is a 400, as in vLLM; "none" renders the tools and
    answers in text. Demanded calls are answered as the message's `tool_calls`.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None, None, False
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    schemas = _function_schemas(body.tools)
    if choice is None or choice == "auto":
        if auto:
            return tools, None, True
        raise bad(
            'tool_choice "auto" (the default with tools) needs a parser of the model\'s '
            "tool-call syntax: start the server with --enable-auto-tool-choice "
            '--tool-call-parser hermes, or send "required", "none" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice == "none":
        return tools, None, False
    if choice == "required":
        # Each tool's schema sits in $defs, its own "#..." references moved along with it.
        defs = {
            f"tool{i}": _rebased(schema, f"#/$defs/tool{i}")
            for i, schema in enumerate(schemas.values())
        }
        one_call = [
            {
                "type": "object",
                "required": ["name", "parameters"],
                "properties": {
                    "name": {"enum": [name]},
                    "parameters": {"$ref": f"#/$defs/tool{i}"},
                },
            }
            for i, name in enumerate(schemas)
        ]
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "$defs": defs,
            "items": {"anyOf": one_call},
        }
        if body.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return tools, ToolCalls(None, StructuredOutputsParams(json=json.dumps(calls))), False
    name = choice.function.name
    if name not in schemas:
        raise bad(f"tool_choice names {name!r:.80}, which is not one of the tools", "tool_choice")
    return tools, ToolCalls(name, StructuredOutputsParams(json=json.dumps(schemas[name]))), False


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with each "$ref" to its own root ("#...") pointing below `root` instead."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: root + value[1:]
        if key == "$ref" and isinstance(value, str) and value.startswith("#")
        else _rebased(value, root)
        for key, value in schema.items()
    }


def _function_schemas(tools: list[Tool]) -> dict[str, dict[str, Any]]:
    """Each function tool's parameters schema (an object's), by name; 400 for a name given
    twice or parameters that describe no object."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, parameters = tool.function.name, tool.function.parameters
        if name in schemas:
            raise bad(f"tools[{i}].function.name {name!r} is given twice", "tools")
        if parameters is not None and parameters.get("type", "object") != "object":
            raise bad(
                f"tools[{i}].function.parameters must describe an object (the call's "
                f"keyword arguments)",
                "tools",
            )
        schemas[name] = {"type": "object", **(parameters or NO_PARAMETERS)}
    return schemas


class ToolCallDeltas:
    """A streamed choice's deltas when its answer is a demanded call: a named function's
    arguments stream as they come; "required" calls are sent whole at the end (their split
    into calls needs the whole JSON)."""

    def __init__(self, tool_calls: ToolCalls) -> None:
        self.tool_calls = tool_calls
        self._held: dict[int, str] = {}  # "required": each choice's text so far

    def first(self) -> dict[str, Any]:
        """The choice's first delta."""
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        function = self.tool_calls.function
        if function is not None:
            delta["tool_calls"] = [
                {
                    "index": 0,
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": function, "arguments": ""},
                }
            ]
        return delta

    def next(
        self, index: int, text: str, finish: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The delta for new `text` (None: nothing to send yet) and the finish reason."""
        if self.tool_calls.function is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish
        held = self._held[index] = self._held.get(index, "") + text
        if finish is None:
            return None, None
        del self._held[index]
        calls = self.tool_calls.calls(held)
        if calls is None:  # cut short: the text as it is
            return {"content": held}, finish
        tool_calls = [{"index": k, **call} for k, call in enumerate(calls)]
        return {"tool_calls": tool_calls}, self.tool_calls.finish(finish)
