"""Function calling in the Responses API, translated to and from chat completions' tools.

Request side: `tools` (`{"type": "function", "name", "description", "parameters", "strict"}`)
become chat tools (`{"type": "function", "function": {...}}`), `tool_choice` its chat form, and
the input items `function_call` and `function_call_output` become the chat messages a model saw
for them: an assistant message with `tool_calls` (consecutive calls share one) and a `tool`
message with the call's id. Stored conversations keep those chat messages; `chat_items` reads
them back as Responses items. Only function tools: a hosted tool (`web_search`, `file_search`,
...) has nothing upstream to run it, and is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from edge.errors import InvalidRequest

_TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})
_CHOICES = frozenset({"none", "auto", "required"})


def _invalid(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is invalid: {what}", param=param, code="invalid_value")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _invalid(f"{where}.{key}", "must be a non-empty string")
    return value


def chat_tools(value: Any) -> list[dict[str, Any]]:
    """Chat tools for the Responses `tools` (an empty list: none)."""
    if not isinstance(value, list):
        raise _invalid("tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(where, "must be an object")
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"'{where}.type' {kind!r} is not supported: only function tools are",
                param=f"{where}.type", code="unsupported_value",
            )  # fmt: skip
        unknown = sorted(set(tool) - _TOOL_FIELDS)
        if unknown:
            raise _invalid(f"{where}.{unknown[0]}", "is not a field of a function tool")
        function: dict[str, Any] = {"name": _string(tool, "name", where)}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _invalid(f"{where}.description", "must be a string")
            function["description"] = description
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _invalid(f"{where}.parameters", "must be a JSON schema object")
            function["parameters"] = parameters
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise _invalid(f"{where}.strict", "must be true or false")
            function["strict"] = strict
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    """The chat `tool_choice` for the Responses one."""
    if isinstance(value, str) and value in _CHOICES:
        if value == "required" and not tools:
            raise _invalid("tool_choice", "'required' needs at least one tool")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = _string(value, "name", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise _invalid("tool_choice.name", f"no tool is named {name!r}")
        return {"type": "function", "function": {"name": name}}
    raise _invalid("tool_choice", "must be none, auto, required or {type: function, name}")


def _output_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # text parts, as the output of a call may be given
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise _invalid(f"{where}[{i}]", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(where, "must be a string")


def function_item(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    """Append the chat message of a `function_call` or `function_call_output` item to `out`."""
    if item["type"] == "function_call":
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise _invalid(f"{where}.arguments", "must be a string of JSON")
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments},
        }
        last = out[-1] if out else None
        if last is not None and last.get("role") == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant message
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    out.append({
        "role": "tool",
        "tool_call_id": _string(item, "call_id", where),
        "content": _output_text(item.get("output"), f"{where}.output"),
    })  # fmt: skip


FUNCTION_ITEMS = ("function_call", "function_call_output")
"""A tuple: a client's `type` may be any JSON value, and a list is unhashable."""


def calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed tool calls of a chat assistant message (none when it has none)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [c for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    """A chat tool call as a Responses `function_call` item."""
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": str(call.get("id") or ""),
            "name": str(function.get("name") or ""),
            "arguments": str(function.get("arguments") or ""), "status": status}  # fmt: skip


def output_item(message: dict[str, Any], item_id: str) -> dict[str, Any]:
    """A chat `tool` message as a Responses `function_call_output` item."""
    content = message.get("content")
    return {"type": "function_call_output", "id": item_id,
            "call_id": str(message.get("tool_call_id") or ""),
            "output": content if isinstance(content, str) else "",
            "status": "completed"}  # fmt: skip


__all__ = [
    "FUNCTION_ITEMS",
    "call_item",
    "calls_of",
    "chat_tool_choice",
    "chat_tools",
    "function_item",
    "output_item",
]
