"""A Llama-3-style chat template rendered to text.

Every message becomes `<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`, after
one `<|begin_of_text|>`, and the prompt ends with the assistant header. Because the template
is a pure function of the message list, turn N+1 of a conversation renders to turn N's prompt,
followed by the assistant's answer and the new messages, and so shares turn N's tokens as a
prefix, just like a real model's template. The stand-in's answers end with `<|eot_id|>` when
they stop naturally, so the cache even holds the answer exactly as the next turn renders it.

An assistant message that made tool calls (`tool_calls`, content null, absent or text) renders
its calls after its text, one line each, `{"name":NAME,"arguments":ARGS}` (compact JSON,
ARGS the arguments string as sent), so a turn that replays them renders deterministically. A
`tool` message renders its content; its optional `tool_call_id` is validated, not rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from backends.sim.tokenizer import BOS_TOKEN, EOS_TOKEN

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class TemplateError(ValueError):
    """The message list cannot be rendered (a 400 for the client)."""


def message_text(content: Any) -> str:
    """`content` as text: a string, null, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or "type" not in part:
                raise TemplateError("each content part must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise TemplateError("a text content part needs a string 'text'")
                parts.append(text)
            else:
                raise TemplateError(f"content part type {part['type']!r} is not supported")
        return "".join(parts)
    raise TemplateError("message content must be a string, a list of parts or null")


def _tool_call_lines(i: int, calls: Any) -> list[str]:
    """One line per call of an assistant message's `tool_calls` (validated here)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise TemplateError(f"{where} must be a list")
    lines = []
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise TemplateError(f"{where}[{j}] must be an object")
        if not isinstance(call.get("id"), str):
            raise TemplateError(f"{where}[{j}].id must be a string")
        if call.get("type", "function") != "function":
            raise TemplateError(f"{where}[{j}].type must be 'function'")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise TemplateError(f"{where}[{j}].function must be an object")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise TemplateError(f"{where}[{j}].function.name must be a non-empty string")
        if not isinstance(arguments, str):
            raise TemplateError(f"{where}[{j}].function.arguments must be a string")
        line = {"name": name, "arguments": arguments}
        lines.append(json.dumps(line, separators=(",", ":"), ensure_ascii=False))
    return lines


def with_tools(prompt: str, tools: Sequence[Any]) -> str:
    """`prompt` (from `render`) with the offered tools' definitions first, in a system turn
    right after `<|begin_of_text|>`, as Llama 3.1's template gives them to the model: requests
    offering the same tools share those tokens (the checked `tools`, compact JSON)."""
    block = json.dumps(list(tools), separators=(",", ":"), ensure_ascii=False)
    head = f"<|start_header_id|>system<|end_header_id|>\n\nTools: {block}{EOS_TOKEN}"
    return BOS_TOKEN + head + prompt.removeprefix(BOS_TOKEN)


def render(messages: Sequence[Any], *, add_generation_prompt: bool = True) -> str:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("'messages' must be a non-empty list")
    out = [BOS_TOKEN]
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise TemplateError(f"messages[{i}].role must be one of {sorted(ROLES)}")
        text = message_text(message.get("content"))
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise TemplateError(
                    f"messages[{i}].tool_calls is only allowed on assistant messages"
                )
            text = "\n".join(([text] if text else []) + _tool_call_lines(i, calls))
        call_id = message.get("tool_call_id")
        if role == "tool" and call_id is not None and not isinstance(call_id, str):
            raise TemplateError(f"messages[{i}].tool_call_id must be a string")
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}{EOS_TOKEN}")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)
