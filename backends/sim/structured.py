"""Structured output on `/v1/chat/completions` (`response_format`), as SGLang constrains it with
a grammar backend.

The stand-in has no model to fill a schema, so the answer is fixed by the request:
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}` answers
the JSON object `backends.sim.tools.arguments` builds from the schema's properties (the values a
tool call's arguments get), and `{"type": "json_object"}` answers `{}`. `{"type": "text"}`, or
no `response_format`, is the ordinary text answer. The JSON is generated through the scheduler
like a tool call's arguments (`ToolCallPlan`), so timing and `max_tokens` behave as for text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from backends.sim.tools import arguments

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FormatError(ValueError):
    """`response_format` is malformed (a 400 for the client)."""


def structured_answer(obj: Mapping[str, Any]) -> str | None:
    """The fixed JSON answer `response_format` asks for; None: answer in text."""
    fmt = obj.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise FormatError("'response_format' must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "{}"
    if kind != "json_schema":
        raise FormatError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise FormatError("response_format.json_schema must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FormatError(
            "response_format.json_schema.name must be a string matching ^[A-Za-z0-9_-]{1,64}$"
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise FormatError("response_format.json_schema.schema must be a JSON schema object")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping) or not all(
        isinstance(p, Mapping) for p in properties.values()
    ):
        raise FormatError("response_format.json_schema.schema.properties must map names to schemas")
    return arguments(schema)


__all__ = ["FormatError", "structured_answer"]
