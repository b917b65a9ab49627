"""Function calling on `/v1/chat/completions`, as SGLang answers with `--tool-call-parser`.

The stand-in has no model to choose a tool, so the choice is a fixed rule on the request: a
call is made only when `tools` are given, `tool_choice` is not `"none"` and the last message is
not a tool result (after one, the model answers in text). A named `tool_choice` calls that tool;
`"required"` the first tool whose name occurs in the last message's text, else the first tool;
`"auto"` the first tool whose name occurs there, else no call (a text answer).

The call's arguments are a JSON object built from the tool's `parameters.properties`, in their
order (`enum`: its first value; `string`: "sim"; `integer`: 1; `number`: 1.5; `boolean`: true;
`array`: []; `object`: {}; anything else: null), serialised compactly. That string is the
answer, generated through the scheduler like any other (`ToolCallPlan`: one token per piece of
about four characters, then end-of-turn), so timing, `max_tokens` and aborts behave as for text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.sim.chat_template import message_text
from backends.sim.tokenizer import EOS_ID, Tokenizer

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
PIECE_CHARS = 4
"""Characters per token of the generated arguments."""

_TYPE_VALUES: dict[str, Any] = {
    "string": "sim",
    "integer": 1,
    "number": 1.5,
    "boolean": True,
    "array": [],
    "object": {},
}


class ToolError(ValueError):
    """`tools`, `tool_choice` or `parallel_tool_calls` is malformed (a 400 for the client)."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]
    """The JSON schema of the arguments (`{}` when the tool declares none)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The one call an answer makes."""

    id: str
    """`call_` and 24 hex digits."""
    name: str
    arguments: str
    """The whole arguments string; the answer's text is (a prefix of, when cut) this."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise ToolError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type must be 'function'")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ToolError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ToolError(f"{where}.function.name must be a string matching ^[A-Za-z0-9_-]{{1,64}}$")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be a boolean")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, Mapping):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object")
    properties = parameters.get("properties")
    if properties is not None:
        if not isinstance(properties, Mapping):
            raise ToolError(f"{where}.function.parameters.properties must be an object")
        for key, schema in properties.items():
            if not isinstance(schema, Mapping):
                raise ToolError(
                    f"{where}.function.parameters.properties.{key} must be a schema object"
                )
            enum = schema.get("enum")
            if enum is not None and (not isinstance(enum, list) or not enum):
                raise ToolError(
                    f"{where}.function.parameters.properties.{key}.enum must be a non-empty list"
                )
    return Tool(name, parameters)


def parse_tools(obj: Mapping[str, Any]) -> tuple[list[Tool], str | Tool]:
    """The request's tools and its tool choice (`"none"`, `"auto"`, `"required"` or the named
    tool). No tools (absent, null or `[]`) reads as `([], "none")`."""
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean")
    raw = obj.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ToolError("'tools' must be a list of function tools")
    tools = [_parse_tool(i, tool) for i, tool in enumerate(raw)]
    by_name: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        if tool.name in by_name:
            raise ToolError(f"tools[{i}].function.name {tool.name!r} is given twice")
        by_name[tool.name] = tool
    choice = obj.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if not tools:
        raise ToolError("'tool_choice' is only allowed when 'tools' are given")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, not {choice!r}"
            )
        return tools, choice
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        raise ToolError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice.function.name must be a string")
    if name not in by_name:
        raise ToolError(f"tool_choice names no tool {name!r}")
    return tools, by_name[name]


def choose(tools: Sequence[Tool], choice: str | Tool, messages: Sequence[Any]) -> Tool | None:
    """The tool the answer calls, or None for a text answer (the messages are validated)."""
    if not tools or choice == "none" or not messages or messages[-1].get("role") == "tool":
        return None
    if isinstance(choice, Tool):
        return choice
    text = message_text(messages[-1].get("content"))
    named = next((tool for tool in tools if tool.name in text), None)
    if named is not None or choice == "auto":
        return named
    return tools[0]  # "required"


def arguments(parameters: Mapping[str, Any]) -> str:
    """The call's arguments: a value per property, from its schema, in the schema's order."""
    properties = parameters.get("properties") or {}
    values: dict[str, Any] = {}
    for key, schema in properties.items():
        enum = schema.get("enum")
        if enum:
            values[key] = enum[0]
            continue
        kind = schema.get("type")
        values[key] = _TYPE_VALUES.get(kind, None) if isinstance(kind, str) else None
    return json.dumps(values, separators=(",", ":"), ensure_ascii=False)


def plan_call(obj: Mapping[str, Any], messages: Sequence[Any]) -> ToolCall | None:
    """Validate the request's tool fields and decide its call (None: answer in text)."""
    tools, choice = parse_tools(obj)
    tool = choose(tools, choice, messages)
    if tool is None:
        return None
    return ToolCall(new_call_id(), tool.name, arguments(tool.parameters))


def split_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class ToolCallPlan:
    """The answer of a call: its arguments, one token per piece, then end-of-turn."""

    __slots__ = ("_tokens",)

    def __init__(self, tokenizer: Tokenizer, arguments: str) -> None:
        self._tokens = [(tokenizer.piece_id(p), p) for p in split_pieces(arguments)]

    def next_token(self, index: int, *, ignore_eos: bool) -> tuple[int, str]:
        if index < len(self._tokens):
            return self._tokens[index]
        return EOS_ID, ""  # past the arguments (ignore_eos keeps asking): end-of-turn only


__all__ = [
    "Tool",
    "ToolCall",
    "ToolCallPlan",
    "ToolError",
    "arguments",
    "choose",
    "new_call_id",
    "parse_tools",
    "plan_call",
    "split_pieces",
]
