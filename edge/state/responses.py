"""The Responses API (`POST /v1/responses`) over an upstream `/v1/chat/completions` request.

The request's `input` (a string, or message items with text parts) becomes chat messages,
`instructions` a leading system message of this request only (as OpenAI does, they are not carried
to the next turn), `max_output_tokens` `max_tokens`. The answer comes back in the Responses shape:
a `response` object, or, streaming, the semantic SSE events `response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`…, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done` and `response.completed` (or `response.incomplete` when the token
budget ended it, `response.failed` when the backend failed); there is no `[DONE]`. Function
tools and the items of a function-calling loop are translated by `edge.state.response_tools`;
a tool call in the answer is a `function_call` item, streamed as
`response.function_call_arguments.*` events.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from edge.errors import InvalidRequest
from edge.state.response_tools import (
    FUNCTION_ITEMS,
    call_item,
    calls_of,
    chat_tool_choice,
    chat_tools,
    function_item,
)

RESPONSES = "/v1/responses"

# Request fields with a chat equivalent (or none needed); anything else is refused by name
# rather than silently dropped.
_PASSED = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
           "user": "user", "seed": "seed"}  # fmt: skip
_ACCEPTED = {"model", "input", "instructions", "previous_response_id", "conversation",
             "store", "stream", "metadata", "parallel_tool_calls", "truncation", "text",
             "tools", "tool_choice", *_PASSED}  # fmt: skip
_ROLES = frozenset({"user", "assistant", "system", "developer"})
# A `developer` message is kept (and read back) as itself and goes upstream as `system`, the
# role every chat template knows.
_UPSTREAM_ROLES = {"developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _invalid(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is invalid: {what}", param=param, code="invalid_value")


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

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        lead = [{"role": "system", "content": self.instructions}] if self.instructions else []
        sent = [
            {**m, "role": _UPSTREAM_ROLES[m["role"]]} if m.get("role") in _UPSTREAM_ROLES else m
            for m in messages
        ]
        return {**self.chat, "messages": [*lead, *sent]}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise _invalid(f"{where}[{i}]", "only input_text/output_text parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{where}[{i}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


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
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise _invalid(where, "only message, function_call and function_call_output items"
                           " are supported")  # fmt: skip
        role = item.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role", "must be user, assistant, system or developer")
        out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
    return out


def _response_format(text: Any) -> dict[str, Any] | None:
    """The chat `response_format` for the Responses `text` (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _invalid("text", "must be an object")
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise InvalidRequest(f"'text.{unknown[0]}' is not supported by this endpoint",
                             param=f"text.{unknown[0]}", code="unsupported_parameter")  # fmt: skip
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


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """Check a `/v1/responses` body and translate it; 400 naming the field otherwise."""
    unknown = sorted(set(body) - _ACCEPTED)
    if unknown:
        raise InvalidRequest(
            f"'{unknown[0]}' is not supported by this endpoint",
            param=unknown[0],
            code="unsupported_parameter",
        )
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
    for name, value in (("store", store), ("stream", stream)):
        if not isinstance(value, bool):
            raise _invalid(name, "must be true or false")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "must be a string")
    if body.get("truncation", "disabled") != "disabled":
        raise _invalid("truncation", "only 'disabled' is supported")
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
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "previous_response_id": previous,
        "store": store,
        **({"conversation": {"id": conversation}} if conversation is not None else {}),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "user": body.get("user"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tools": body.get("tools") or [],
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    return ResponsesRequest(
        new, instructions, previous, conversation, store, stream, model, chat, echo
    )


def conversation_items(body: Any) -> list[dict[str, Any]]:
    """The chat messages of `POST /v1/conversations`' `items` (none without it); 400 naming a
    bad field, as for `input`."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    unknown = sorted(set(body) - {"items", "metadata"})
    if unknown:
        raise InvalidRequest(f"'{unknown[0]}' is not supported by this endpoint",
                             param=unknown[0], code="unsupported_parameter")  # fmt: skip
    items = body.get("items")
    return [] if items is None or items == [] else _messages(items, "items")


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens") or 0
    output = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


@dataclass(slots=True)
class _Call:
    """One function call of the answer, as it streams in."""

    item_id: str
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def chat(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}  # fmt: skip


_MESSAGE = "message"
"""The place of the text message among the output items (`ResponseBuilder._items`)."""


class ResponseBuilder:
    """The `response` object of one answer, and its streamed events.

    The output items are the text message and the function calls, in the order the answer
    started them; a stream opens each item at its first delta, and an answer with neither
    still has one (empty) message."""

    def __init__(self, echo: dict[str, Any], response_id: str, model: str) -> None:
        self.echo = echo
        """The request's fields the response object repeats (`ResponsesRequest.echo`)."""
        self.id = response_id
        self.message_id = "msg_" + os.urandom(16).hex()
        self.model = model
        self.created = int(time.time())
        self._sequence = 0
        self._text: list[str] = []
        self._items: list[_Call | str] = []
        self._calls: dict[int, _Call] = {}
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self._buffer = b""
        self.began = False
        self.ended = False
        self.failed: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self._text)

    def reply(self) -> dict[str, Any]:
        """The answer as the chat assistant message a conversation stores."""
        calls = [item.chat() for item in self._items if isinstance(item, _Call)]
        if not calls:
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": self.text or None, "tool_calls": calls}

    def _message(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": self.text, "annotations": []}]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def _output(self, status: str) -> list[dict[str, Any]]:
        return [call_item(item.chat(), item.item_id, status) if isinstance(item, _Call)
                else self._message(status) for item in self._items or [_MESSAGE]]  # fmt: skip

    def response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": self.failed,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "model": self.model,
            "output": self._output("completed" if status == "completed" else status)
            if done and self.failed is None else [],
            "parallel_tool_calls": True,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": self._usage if done else None,
            **self.echo,
        }  # fmt: skip

    def stored(self) -> dict[str, Any]:
        """What a stored turn keeps of this answer to give it back (`History.meta`)."""
        calls = [item.item_id for item in self._items if isinstance(item, _Call)]
        return {"id": self.message_id, "created_at": self.created, "model": self.model,
                "status": self._status(), "usage": self._usage, "echo": self.echo,
                **({"calls": calls} if calls else {})}  # fmt: skip

    @classmethod
    def restored(
        cls, response_id: str, reply: dict[str, Any], meta: dict[str, Any]
    ) -> ResponseBuilder:
        """The answer of a stored turn, from its chat message and `stored()` (`GET
        /v1/responses/ID`). A turn stored without them gets a time of 0 and no model or usage."""
        echo = meta.get("echo")
        builder = cls(echo if isinstance(echo, dict) else {}, response_id,
                      str(meta.get("model") or "default"))  # fmt: skip
        builder.message_id = str(meta.get("id") or builder.message_id)
        builder.created = int(meta.get("created_at") or 0)
        builder._answer(reply, meta.get("calls"))
        builder._usage = meta.get("usage")
        builder._finish = "length" if meta.get("status") == "incomplete" else "stop"
        builder.began = builder.ended = True
        return builder

    def _answer(self, message: Any, ids: Any = None) -> None:
        """The items of a whole chat message (its text, then its calls)."""
        text = message.get("content") if isinstance(message, dict) else None
        calls = calls_of(message) if isinstance(message, dict) else []
        self._text = [text] if isinstance(text, str) else []
        if self._text and self._text[0] or not calls:
            self._items.append(_MESSAGE)
        for k, call in enumerate(calls):
            function = call["function"]
            item_id = ids[k] if isinstance(ids, list) and k < len(ids) else self._call_id(k)
            opened = _Call(item_id, str(call.get("id") or ""), str(function.get("name") or ""),
                           [str(function.get("arguments") or "")])  # fmt: skip
            self._calls[k] = opened
            self._items.append(opened)

    def _call_id(self, index: int) -> str:
        return f"fc_{self.id.removeprefix('resp_')}{index:02x}"

    def _status(self) -> str:
        if self.failed is not None:
            return "failed"
        return "incomplete" if self._finish == "length" else "completed"

    # -- a whole (non-streaming) answer ----------------------------------------------------

    def from_chat_body(self, body: bytes) -> bytes | None:
        """The response object for a chat.completion body (None when it is not one)."""
        try:
            obj = orjson.loads(body)
            choice = obj["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        if not isinstance(message, dict):
            return None
        self._answer(message)
        self._finish = choice.get("finish_reason")
        self._usage = _usage(obj.get("usage"))
        if isinstance(obj.get("model"), str):
            self.model = obj["model"]
        self.ended = True
        return orjson.dumps(self.response(self._status()))

    # -- a stream --------------------------------------------------------------------------

    def _event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def _begin(self) -> bytes:
        self.began = True
        return b"".join((
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ))  # fmt: skip

    def _open_message(self) -> bytes:
        index = len(self._items)
        self._items.append(_MESSAGE)
        return b"".join((
            self._event("response.output_item.added", output_index=index,
                        item={**self._message("in_progress"), "content": []}),
            self._event("response.content_part.added", item_id=self.message_id,
                        output_index=index, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []}),
        ))  # fmt: skip

    def feed(self, chunk: bytes) -> bytes:
        """Responses events for a piece of the upstream chat stream."""
        out = [] if self.began else [self._begin()]
        data = self._buffer + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b"".join(out)
        self._buffer = data[end + 2 :]
        for event in data[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(self._data(line[5:].strip()))
        return b"".join(out)

    def _data(self, payload: bytes) -> bytes:
        if self.ended:
            return b""
        if payload == b"[DONE]":
            return self.finish()
        try:
            obj = orjson.loads(payload)
        except ValueError:
            return b""
        if not isinstance(obj, dict):
            return b""
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            self.failed = {"code": str(err.get("code") or "server_error"),
                           "message": str(err.get("message") or "backend error")}  # fmt: skip
            return self.finish()
        if obj.get("usage"):
            self._usage = _usage(obj["usage"])
        if isinstance(obj.get("model"), str):
            self.model = obj["model"]
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return b""
        choice = choices[0]
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return b""
        out = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            if _MESSAGE not in self._items:
                out.append(self._open_message())
            self._text.append(text)
            out.append(self._event("response.output_text.delta", item_id=self.message_id,
                                   output_index=self._items.index(_MESSAGE), content_index=0,
                                   delta=text, logprobs=[]))  # fmt: skip
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            out += [self._call_delta(call) for call in calls if isinstance(call, dict)]
        return b"".join(out)

    def _call_delta(self, delta: dict[str, Any]) -> bytes:
        """Events for one tool call's delta: the item at its first, then its arguments."""
        raw_index, raw_function = delta.get("index"), delta.get("function")
        index = raw_index if isinstance(raw_index, int) else 0
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        call = self._calls.get(index)
        out = []
        if call is None:
            call = self._calls[index] = _Call(self._call_id(index), str(delta.get("id") or ""),
                                              str(function.get("name") or ""))  # fmt: skip
            self._items.append(call)
            item = call_item(call.chat(), call.item_id, "in_progress")
            out.append(self._event("response.output_item.added",
                                   output_index=len(self._items) - 1, item=item))  # fmt: skip
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.arguments.append(arguments)
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=call.item_id, output_index=self._items.index(call),
                                   delta=arguments))  # fmt: skip
        return b"".join(out)

    def finish(self) -> bytes:
        """The closing events (once): each item's text or arguments, then the item, then the
        final response."""
        if self.ended:
            return b""
        self.ended = True
        status = self._status()
        out = [] if self.began else [self._begin()]
        if self.failed is None:
            if not self._items:
                out.append(self._open_message())  # an empty answer is an empty message
            state = "completed" if status == "completed" else status
            for index, item in enumerate(self._items):
                if isinstance(item, _Call):
                    whole = call_item(item.chat(), item.item_id, state)
                    out += [
                        self._event("response.function_call_arguments.done",
                                    item_id=item.item_id, output_index=index,
                                    name=item.name, arguments=whole["arguments"]),
                        self._event("response.output_item.done", output_index=index, item=whole),
                    ]  # fmt: skip
                    continue
                out += [
                    self._event("response.output_text.done", item_id=self.message_id,
                                output_index=index, content_index=0, text=self.text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.message_id,
                                output_index=index, content_index=0, part=self._part()),
                    self._event("response.output_item.done", output_index=index,
                                item=self._message(state)),
                ]  # fmt: skip
        out.append(self._event(f"response.{status}", response=self.response(status)))
        return b"".join(out)


__all__ = [
    "RESPONSES",
    "ResponseBuilder",
    "ResponsesRequest",
    "conversation_items",
    "parse_request",
]
