"""The Responses API (`POST /v1/responses`) over an upstream `/v1/chat/completions` request:
the request's side (the answer's is `edge.state.response_builder`).

The request's `input` (a string, or message items with text and image parts, function calls and
their outputs) becomes chat messages, `instructions` a leading system message of this request
only (as OpenAI does, they are not carried to the next turn), `max_output_tokens` `max_tokens`,
`text.format` the `response_format`, `reasoning.effort` the `reasoning_effort`, and `include`'s
logprobs the chat `logprobs`. Function tools and the items of a function-calling loop are
translated by `edge.state.response_tools`. A member with no chat equivalent is refused by name
(`check_known`), never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from edge.errors import InvalidRequest
from edge.state.response_tools import (
    FUNCTION_ITEMS,
    chat_tool_choice,
    chat_tools,
    function_item,
)

RESPONSES = "/v1/responses"

# Request fields with a chat equivalent (or none needed); anything else is refused by name
# rather than silently dropped.
_PASSED = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
           "user": "user", "seed": "seed", "prompt_cache_key": "prompt_cache_key"}  # fmt: skip
# Fields whose only values here are the ones that need nothing done (checked by `_settled`).
_SETTLED = {"background", "service_tier", "stream_options", "max_tool_calls",
            "prompt_cache_retention", "safety_identifier"}  # fmt: skip
_ACCEPTED = {"model", "input", "instructions", "previous_response_id", "conversation",
             "store", "stream", "metadata", "parallel_tool_calls", "truncation", "text",
             "tools", "tool_choice", "reasoning", "include", "top_logprobs",
             *_PASSED, *_SETTLED}  # fmt: skip
# Tuples, not sets: a client's value may be any JSON (a list is unhashable).
_INCLUDES = ("message.output_text.logprobs",)
# OpenAI's tiers, which SGLang takes as they are ("none" turns a template's thinking off).
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_ROLES = ("user", "assistant", "system", "developer")
# A `developer` message is kept (and read back) as itself and goes upstream as `system`, the
# role every chat template knows.
_UPSTREAM_ROLES = {"developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _invalid(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is invalid: {what}", param=param, code="invalid_value")


MAX_METADATA = 16
"""OpenAI's metadata: at most this many pairs, keys up to 64 characters, values up to 512."""


def check_metadata(value: Any) -> dict[str, str]:
    """OpenAI's `metadata`, wherever one is taken (chat `store: true` and its update,
    `/v1/responses`, conversations' create and update): at most 16 string pairs, keys up to 64
    characters, values up to 512; a 400 naming `metadata` otherwise. Stored objects grow by no
    more than that."""
    if not isinstance(value, dict):
        raise InvalidRequest("'metadata' must be an object", param="metadata")
    if len(value) > MAX_METADATA or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in value.items()
    ):
        raise InvalidRequest(
            "'metadata' holds at most 16 string values, keys up to 64 characters and values "
            "up to 512",
            param="metadata",
        )
    return value


def check_known(obj: dict[str, Any], known: Any, within: str = "") -> None:
    """400 `unsupported_parameter` naming the first member of `obj` not in `known` (`within`:
    the object's own name, `text.` or `reasoning.`): refused by name, never silently dropped."""
    unknown = sorted(set(obj) - set(known))
    if unknown:
        param = within + unknown[0]
        raise InvalidRequest(f"'{param}' is not supported by this endpoint", param=param,
                             code="unsupported_parameter")  # fmt: skip


@dataclass(slots=True)
class ResponsesRequest:
    """What a `/v1/responses` body asks for, in chat terms."""

    new: list[dict[str, Any]]
    """The new turn's messages (without the instructions)."""
    instructions: str | None
    previous: str | None
    conversation: str | None
    """The stored conversation (`conv_…`) this turn continues, at its latest turn."""
    store: bool
    stream: bool
    model: str | None
    chat: dict[str, Any]
    """The chat body's other members (sampling, stream, model)."""
    echo: dict[str, Any] = field(default_factory=dict)
    """Request fields echoed in the response object."""
    truncate: bool | None = None
    """`truncation`: "auto" (True) drops a conversation's oldest turns past its size limit,
    "disabled" (False) refuses the turn; None when not given (the edge's `overflow`)."""
    background: bool = False
    """Answered at once, `queued`, and generated without the client (`edge.state.background`)."""

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        lead = [{"role": "system", "content": self.instructions}] if self.instructions else []
        sent = [
            {**m, "role": _UPSTREAM_ROLES[m["role"]]} if m.get("role") in _UPSTREAM_ROLES else m
            for m in messages
        ]
        return {**self.chat, "messages": [*lead, *sent]}


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `input_image` part as the chat `image_url` part a vision model's template takes."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _invalid(f"{where}.image_url", "must be a URL or a data: URL (file_id is not kept)")
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail is not None:
        if detail not in ("auto", "low", "high"):
            raise _invalid(f"{where}.detail", "must be auto, low or high")
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content in chat terms: its text, or the chat parts when it has an image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of text and image parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image_part(part, f"{where}[{i}]"))
            continue
        if kind not in _TEXT_PARTS:
            raise _invalid(f"{where}[{i}]", "only input_text, output_text and input_image parts"
                           " are supported")  # fmt: skip
        text = part.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{where}[{i}].text", "must be a string")
        parts.append({"type": "text", "text": text})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # text only: one string, as before
    return parts


def _messages(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """Chat messages from Responses input items (`param` names the field in errors)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _invalid(param, "must be a string or a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if isinstance(item, dict) and item.get("type") in FUNCTION_ITEMS:
            function_item(item, where, out)
            continue
        if isinstance(item, dict) and item.get("type") == "reasoning":
            # An earlier answer's thinking, given back with it (`input += response.output`):
            # a model is given its earlier answers without their thinking, as a stored
            # conversation keeps them.
            continue
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise _invalid(where, "only message, reasoning, function_call and "
                           "function_call_output items are supported")  # fmt: skip
        role = item.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role", "must be user, assistant, system or developer")
        out.append({"role": role, "content": _content_of(item.get("content"), f"{where}.content")})
    if not out:
        raise _invalid(param, "holds no message, function_call or function_call_output item")
    return out


def _logprobs(body: dict[str, Any], chat: dict[str, Any]) -> int | None:
    """`include: ["message.output_text.logprobs"]` and `top_logprobs` as the chat `logprobs`
    and `top_logprobs` (set in `chat`); the `top_logprobs` asked for."""
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _invalid("include", "must be a list")
    for i, name in enumerate(include):
        if name not in _INCLUDES:
            raise InvalidRequest(f"'include[{i}]' {name!r} is not supported: only "
                                 "message.output_text.logprobs", param=f"include[{i}]",
                                 code="unsupported_value")  # fmt: skip
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise _invalid("top_logprobs", "must be an integer from 0 to 20")
    if include or top:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    return top


def _reasoning_effort(reasoning: Any) -> str | None:
    """The chat `reasoning_effort` for the Responses `reasoning` (None: the model's default).
    A summary of the thinking is not something a backend makes: asked for, it is a 400."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _invalid("reasoning", "must be an object")
    check_known(reasoning, {"effort", "summary", "generate_summary"}, "reasoning.")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise InvalidRequest(
                f"'reasoning.{key}' is not supported: the thinking comes whole, as a reasoning "
                "item's reasoning_text", param=f"reasoning.{key}", code="unsupported_parameter",
            )  # fmt: skip
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise _invalid("reasoning.effort", "must be one of " + ", ".join(_EFFORTS))
    return effort if isinstance(effort, str) else None


def _response_format(text: Any) -> dict[str, Any] | None:
    """The chat `response_format` for the Responses `text` (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _invalid("text", "must be an object")
    check_known(text, {"format"}, "text.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _invalid("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _invalid("text.format.type", "must be text, json_object or json_schema")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name:
        raise _invalid("text.format.name", "must be a non-empty string")
    if not isinstance(schema, dict):
        raise _invalid("text.format.schema", "must be a JSON schema object")
    spec = {"name": name, "schema": schema}
    spec.update({k: fmt[k] for k in ("description", "strict") if fmt.get(k) is not None})
    return {"type": "json_schema", "json_schema": spec}


def _unsupported(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' {why}", param=param, code="unsupported_parameter")


def _settled(body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """Check the fields an SDK may send that need nothing of a backend at the values taken
    here; what the response echoes of them. Another value is a 400 saying why."""
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "must be auto or default: this edge has one tier")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid("stream_options", "must be an object")
        check_known(options, {"include_obfuscation"}, "stream_options.")
        if options.get("include_obfuscation") not in (None, False):
            raise _unsupported("stream_options.include_obfuscation",
                               "is not supported: events are not padded")  # fmt: skip
    calls = body.get("max_tool_calls")
    if calls is not None and (not isinstance(calls, int) or isinstance(calls, bool) or calls < 0):
        raise _invalid("max_tool_calls", "must be an integer >= 0")
    if body.get("prompt_cache_retention") not in (None, "in_memory"):
        why = "must be in_memory: backends keep prefixes in their memory only"
        raise _unsupported("prompt_cache_retention", why)
    safety = body.get("safety_identifier")
    if safety is not None and not isinstance(safety, str):
        raise _invalid("safety_identifier", "must be a string")
    if safety and "user" not in chat:  # the end user, as chat names them (and routing reads)
        chat["user"] = safety
    return {"service_tier": "default" if tier else None,
            "max_tool_calls": calls, "safety_identifier": safety}  # fmt: skip


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """Check a `/v1/responses` body and translate it; 400 naming the field otherwise."""
    check_known(body, _ACCEPTED)
    if "input" not in body:
        raise InvalidRequest("'input' is required", param="input", code="missing_field")
    new = _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions", "must be a string")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _invalid("previous_response_id", "must be a string")
    conversation = body.get("conversation")
    if isinstance(conversation, dict):  # {"id": "conv_…"}, as the SDK may send it
        conversation = conversation.get("id")
    if conversation is not None and not isinstance(conversation, str):
        raise _invalid("conversation", 'must be a conversation id or {"id": ...}')
    if conversation is not None and previous is not None:
        raise _invalid("conversation", "give previous_response_id or conversation, not both")
    store, stream = body.get("store", True), body.get("stream", False)
    background = body.get("background", False)
    for name, value in (("store", store), ("stream", stream), ("background", background)):
        if not isinstance(value, bool):
            raise _invalid(name, "must be true or false")
    if background and not store:
        raise _invalid("background", "needs store: true (the answer is stored to be polled)")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "must be a string")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise _invalid("truncation", "must be auto or disabled")
    chat: dict[str, Any] = {}
    if model is not None:
        chat["model"] = model
    for source, target in _PASSED.items():
        if body.get(source) is not None:
            chat[target] = body[source]
    tools = chat_tools(body["tools"]) if body.get("tools") is not None else []
    tool_choice = body.get("tool_choice", "auto")
    choice = chat_tool_choice(tool_choice, tools)  # checked with or without tools
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls", "must be true or false")
    if tools:  # the chat fields only with tools: a backend may refuse a choice among none
        chat["tools"] = tools
        chat["tool_choice"] = choice
        if not parallel:
            chat["parallel_tool_calls"] = False
    top = _logprobs(body, chat)
    settled = _settled(body, chat)
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": {} if body.get("metadata") is None else check_metadata(body["metadata"]),
        "previous_response_id": previous,
        "store": store,
        **({"conversation": {"id": conversation}} if conversation is not None else {}),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "user": body.get("user"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "top_logprobs": top,
        "reasoning": {"effort": effort, "summary": None},
        "text": body.get("text") or {"format": {"type": "text"}},
        "tools": body.get("tools") or [],
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        **settled,
        "background": background,
    }
    if truncation is not None:
        echo["truncation"] = truncation
    truncate = None if truncation is None else truncation == "auto"
    return ResponsesRequest(new, instructions, previous, conversation, store, stream, model,
                            chat, echo, truncate, background)  # fmt: skip


# The chat fields `parse_request` sends under another name, by the Responses field they came
# from; a backend's refusal names the client's field, not one it never sent. The fields sent
# under their own name (`temperature`, `top_p`, `seed`, `tools`, ...) need no renaming.
_FROM_CHAT = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "messages": "input", "response_format": "text.format",
              "reasoning_effort": "reasoning.effort"}  # fmt: skip
_CHAT_FIELDS = (*_FROM_CHAT, "temperature", "top_p", "seed", "user", "prompt_cache_key",
                "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "model")  # fmt: skip
_NAMES = "|".join(sorted(_CHAT_FIELDS, key=len, reverse=True))
# A chat field as an error message names it: quoted, at the head of a path (`messages[0]`,
# a pydantic location line), or bare when its name cannot be an English word (`max_tokens`).
_NAMED = re.compile(
    rf"(?P<q>['\"`])(?P<quoted>{_NAMES})(?P=q)"
    rf"|(?<![\w.])(?P<path>{_NAMES})(?=[\[.])"
    rf"|(?<![\w.])(?P<bare>\w+_\w+)(?![\w])"
)
MAX_REFUSAL_BYTES = 65536
"""The most of a backend's refusal body read for its message (they are a few hundred bytes)."""
_MAX_MESSAGE = 2000


def _rename(match: re.Match[str]) -> str:
    name = match.group("quoted") or match.group("path") or match.group("bare")
    # `messages[N]` counts the whole prompt (history, instructions): no place in `input`
    if name == "messages" or name not in _FROM_CHAT:
        return match.group(0)
    return match.group(0).replace(name, _FROM_CHAT[name], 1)


def _param_of(param: Any, message: str) -> str | None:
    """The Responses field a backend's refusal is about: its `param` or the first chat field
    its message names, by its Responses name; None when it names none."""
    if isinstance(param, str) and param:
        top = re.match(r"\w+", param)
        name = top.group(0) if top is not None else param
        return _FROM_CHAT.get(name, name)
    for match in _NAMED.finditer(message):
        name = match.group("quoted") or match.group("path") or match.group("bare")
        if name in _CHAT_FIELDS:
            return _FROM_CHAT.get(name, name)
    return None


def _refusal_parts(body: bytes) -> tuple[str, Any, Any]:
    """(message, param, code) of a backend's error body: SGLang's
    `{"object": "error", "message", "param", "code"}`, OpenAI's `{"error": {...}}`, FastAPI's
    `{"detail": ...}`, or text."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip(), None, None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        obj = obj["error"]
    if not isinstance(obj, dict):
        return "", None, None
    for key in ("message", "error"):
        if isinstance(obj.get(key), str):
            return obj[key], obj.get("param"), obj.get("code")
    detail = obj.get("detail")
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = [str(p) for p in first.get("loc") or [] if p != "body"]
        msg = str(first.get("msg", ""))
        return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None), None
    return (detail if isinstance(detail, str) else ""), None, None


def refusal(status: int, body: bytes) -> dict[str, Any]:
    """A backend's 4xx or 5xx answer to a `/v1/responses` request's chat translation, as
    OpenAI's error object: its message with the chat fields renamed to the Responses fields
    they came from (`max_tokens` is `max_output_tokens`), `param` the field it is about (None
    when it names none), and the backend's `code` when it is a string (SGLang's is the
    status). A 4xx is an `invalid_request_error`, coded `invalid_value` with a field and
    `invalid_request` without; a 5xx a `server_error`, coded `backend_error`."""
    message, param, code = _refusal_parts(body[:MAX_REFUSAL_BYTES])
    message = message[:_MAX_MESSAGE]
    failed = status >= 500
    named = None if failed else _param_of(param, message)
    default = f"the backend {'failed' if failed else 'refused the request'} ({status})"
    message = _NAMED.sub(_rename, message) or default
    if (not isinstance(code, str) or not code) and failed:
        code = "backend_error"
    elif not isinstance(code, str) or not code:
        code = "invalid_value" if named is not None else "invalid_request"
    kind = "server_error" if failed else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": named, "code": code}}


def conversation_items(body: Any) -> list[dict[str, Any]]:
    """The chat messages of `POST /v1/conversations`' `items` (none without it); 400 naming a
    bad field, as for `input`."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    check_known(body, {"items", "metadata"})
    items = body.get("items")
    return [] if items is None or items == [] else _messages(items, "items")


__all__ = [
    "RESPONSES",
    "ResponsesRequest",
    "check_known",
    "check_metadata",
    "conversation_items",
    "parse_request",
    "refusal",
]
