"""A Llama-3-style chat template rendered to text.

Every message becomes `<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`, after
one `<|begin_of_text|>`, and the prompt ends with the assistant header. Because the template
is a pure function of the message list, turn N+1 of a conversation renders to turn N's prompt,
followed by the assistant's answer and the new messages, and so shares turn N's tokens as a
prefix, just like a real model's template. The stand-in's answers end with `<|eot_id|>` when
they stop naturally, so the cache even holds the answer exactly as the next turn renders it.
"""

from __future__ import annotations

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
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}{EOS_TOKEN}")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)
