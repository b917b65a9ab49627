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
from edge.state.chat_answer import MESSAGE, REASONING, Call, ChatAnswer
from edge.state.response_tools import (
    FUNCTION_ITEMS,
    call_item,
    chat_tool_choice,
    chat_tools,
    function_item,
)

RESPONSES = "/v1/responses"

# Request fields with a chat equivalent (or none needed); anything else is refused by name
# rather than silently dropped.
_PASSED = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
           "user": "user", "seed": "seed", "prompt_cache_key": "prompt_cache_key"}  # fmt: skip
_ACCEPTED = {"model", "input", "instructions", "previous_response_id", "conversation",
             "store", "stream", "metadata", "parallel_tool_calls", "truncation", "text",
             "tools", "tool_choice", "reasoning", "include", "top_logprobs",
             *_PASSED}  # fmt: skip
_INCLUDES = frozenset({"message.output_text.logprobs"})
_EFFORTS = frozenset({"minimal", "low", "medium", "high"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})
# A `developer` message is kept (and read back) as itself and goes upstream as `system`, the
# role every chat template knows.
_UPSTREAM_ROLES = {"developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _invalid(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is invalid: {what}", param=param, code="invalid_value")


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
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise _invalid(where, "only message, function_call and function_call_output items"
                           " are supported")  # fmt: skip
        role = item.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role", "must be user, assistant, system or developer")
        out.append({"role": role, "content": _content_of(item.get("content"), f"{where}.content")})
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
        raise _invalid("reasoning.effort", "must be minimal, low, medium or high")
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
    top = _logprobs(body, chat)
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
        "metadata": body.get("metadata") or {},
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
    }
    return ResponsesRequest(
        new, instructions, previous, conversation, store, stream, model, chat, echo
    )


def conversation_items(body: Any) -> list[dict[str, Any]]:
    """The chat messages of `POST /v1/conversations`' `items` (none without it); 400 naming a
    bad field, as for `input`."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    check_known(body, {"items", "metadata"})
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


class ResponseBuilder:
    """The `response` object of one answer, and its streamed events.

    The output items are the answer's parts (`ChatAnswer`): its text message and its function
    calls, in the order they began; a stream opens each item at its first delta, and an answer
    with neither still has one (empty) message."""

    def __init__(self, echo: dict[str, Any], response_id: str, model: str) -> None:
        self.echo = echo
        """The request's fields the response object repeats (`ResponsesRequest.echo`)."""
        self.id = response_id
        self.message_id = "msg_" + os.urandom(16).hex()
        self.reasoning_id = "rs_" + os.urandom(16).hex()
        self.model = model
        self.created = int(time.time())
        self.answer = ChatAnswer(self._call_id)
        self._sequence = 0
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self.began = False
        self.ended = False
        self.failed: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.answer.text

    def reply(self) -> dict[str, Any]:
        """The answer as the chat assistant message a conversation stores."""
        return self.answer.reply()

    def _call_id(self, index: int) -> str:
        return f"fc_{self.id.removeprefix('resp_')}{index:02x}"

    def _message(self, status: str) -> dict[str, Any]:
        content = [self._part()]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def _reasoning(self, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": self.answer.reasoning}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content,
                "status": status}  # fmt: skip

    def _item(self, part: Call | str, status: str) -> dict[str, Any]:
        if isinstance(part, Call):
            return call_item(part.chat(), part.item_id, status)
        return self._reasoning(status) if part == REASONING else self._message(status)

    def _output(self, status: str) -> list[dict[str, Any]]:
        return [self._item(part, status) for part in self.answer.parts or [MESSAGE]]

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
        calls = [call.item_id for call in self.answer.calls]
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
        builder.answer.take_message(reply, meta.get("calls"))
        builder._usage = meta.get("usage")
        builder._finish = "length" if meta.get("status") == "incomplete" else "stop"
        builder.began = builder.ended = True
        return builder

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
        self.answer.take_message(message, logprobs=choice.get("logprobs"))
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
        part: dict[str, Any] = {"type": "output_text", "text": self.text, "annotations": []}
        if self.answer.logprobs:
            part["logprobs"] = self.answer.logprobs
        return part

    def _begin(self) -> bytes:
        self.began = True
        return b"".join((
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ))  # fmt: skip

    def _opened(self, part: Call | str, index: int) -> bytes:
        """The events that open an output item."""
        if isinstance(part, Call):
            item = call_item(part.chat(), part.item_id, "in_progress")
            return self._event("response.output_item.added", output_index=index, item=item)
        if part == REASONING:
            item = {**self._reasoning("in_progress"), "content": []}
            return self._event("response.output_item.added", output_index=index, item=item)
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
        out += [self._data(payload) for payload in self.answer.feed(chunk)]
        return b"".join(out)

    def _data(self, obj: Any) -> bytes:
        if self.ended:
            return b""
        if obj == b"[DONE]":
            return self.finish()
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
        out = []
        answer = self.answer
        for kind, part, piece in answer.take_chunk(obj):
            if kind == "open":
                out.append(self._opened(part, answer.index(part)))
            elif kind == "text":
                out.append(self._event("response.output_text.delta", item_id=self.message_id,
                                       output_index=answer.index(MESSAGE), content_index=0,
                                       delta=piece, logprobs=part or []))  # fmt: skip
            elif kind == "reasoning":
                out.append(self._event("response.reasoning_text.delta",
                                       item_id=self.reasoning_id,
                                       output_index=answer.index(REASONING), content_index=0,
                                       delta=piece))  # fmt: skip
            else:
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=part.item_id, output_index=answer.index(part),
                                       delta=piece))  # fmt: skip
        self._finish = self.answer.finish or self._finish
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
            parts = self.answer.parts
            if not parts:  # an empty answer is an empty message
                parts.append(MESSAGE)
                out.append(self._opened(MESSAGE, 0))
            state = "completed" if status == "completed" else status
            for index, part in enumerate(parts):
                if part == REASONING:
                    out += [
                        self._event("response.reasoning_text.done", item_id=self.reasoning_id,
                                    output_index=index, content_index=0,
                                    text=self.answer.reasoning),
                        self._event("response.output_item.done", output_index=index,
                                    item=self._reasoning(state)),
                    ]  # fmt: skip
                    continue
                if isinstance(part, Call):
                    whole = call_item(part.chat(), part.item_id, state)
                    out += [
                        self._event("response.function_call_arguments.done",
                                    item_id=part.item_id, output_index=index,
                                    name=part.name, arguments=whole["arguments"]),
                        self._event("response.output_item.done", output_index=index, item=whole),
                    ]  # fmt: skip
                    continue
                out += [
                    self._event("response.output_text.done", item_id=self.message_id,
                                output_index=index, content_index=0, text=self.text,
                                logprobs=self.answer.logprobs),
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
