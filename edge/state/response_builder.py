"""The answer of a `/v1/responses` request, in the Responses shape, from the upstream chat
completion (`edge.state.responses` translates the request).

A whole answer becomes a `response` object; a stream becomes the semantic SSE events
(`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
its deltas and its `.done` events, and last `response.completed`, `response.incomplete` when the
token budget or a stream rule (`content_filter`) ended it, or `response.failed` when the backend
failed); there is no `[DONE]`. The items are the answer's parts as `ChatAnswer` gathers them: a
reasoning model's thinking (`reasoning`), the text (`message`) and each tool call
(`function_call`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from edge.sse import usage_from
from edge.state.chat_answer import MESSAGE, REASONING, Call, ChatAnswer
from edge.state.response_tools import call_item

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""The chat `finish_reason`s that leave a response `incomplete`, and its
`incomplete_details.reason` for each."""


ABORTED = "the backend aborted this answer before it ended"
NOT_CHAT = "the backend's answer was not a chat completion"


def _incomplete(finish: object) -> str | None:
    """The `incomplete_details.reason` of a chat `finish_reason` (any JSON the backend sent),
    or None when the answer is complete."""
    return _INCOMPLETE.get(finish) if isinstance(finish, str) else None


def _usage(obj: Any) -> dict[str, Any] | None:
    """The Responses `usage` of a chat answer or chunk `obj` that reports one; a count that is
    not an integer is taken as 0 (`usage_from` reads the backend's numbers)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
        return None
    counts = usage_from(obj)
    prompt, output = counts.prompt_tokens or 0, counts.completion_tokens or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": counts.cached_tokens or 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(obj["usage"], output)},
        "total_tokens": prompt + output,
    }


def _reasoning_tokens(usage: dict[str, Any], output: int) -> int:
    """The thinking's share of the output tokens: SGLang's `usage.reasoning_tokens` (with
    `--reasoning-parser`), or OpenAI's `completion_tokens_details.reasoning_tokens`; 0 when
    neither is a count (never more than the output)."""
    count = usage.get("reasoning_tokens")
    details = usage.get("completion_tokens_details")
    if type(count) is not int and isinstance(details, dict):
        count = details.get("reasoning_tokens")
    return min(count, output) if type(count) is int and count > 0 else 0


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
        self._announced = False

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
        done = status in ("completed", "incomplete", "failed")  # not queued, running, cancelled
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": self.failed,
            "incomplete_details": {"reason": _incomplete(self._finish) or "max_output_tokens"}
            if status == "incomplete" else None,
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
                **({"finish": self._finish} if _incomplete(self._finish) else {}),
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
        incomplete = meta.get("status") == "incomplete"
        builder._finish = (meta.get("finish") or "length") if incomplete else "stop"
        builder.began = builder.ended = True
        return builder

    @classmethod
    def pending(
        cls, response_id: str, meta: dict[str, Any], error: dict[str, Any] | None = None
    ) -> ResponseBuilder:
        """A background answer with nothing to show yet, or none ever (cancelled, failed with
        `error`), from `stored()`."""
        echo = meta.get("echo")
        builder = cls(echo if isinstance(echo, dict) else {}, response_id,
                      str(meta.get("model") or "default"))  # fmt: skip
        builder.created = int(meta.get("created_at") or 0)
        builder.failed = error
        return builder

    def _status(self) -> str:
        if self.failed is None and self._finish == "abort":
            # SGLang ends an aborted answer (a restart, `/abort_request`, a full KV pool) as any
            # other, its finish `abort`: cut short by the backend, it is no answer completed.
            self.failed = {"code": "server_error", "message": ABORTED}
        if self.failed is not None:
            return "failed"
        return "incomplete" if _incomplete(self._finish) else "completed"

    # -- a whole (non-streaming) answer ----------------------------------------------------

    def from_chat_body(self, body: bytes) -> bytes:
        """The response object for a chat.completion body; a `failed` one when the body is
        not one (the backend's own bytes are no answer to a `/v1/responses` request)."""
        try:
            obj = orjson.loads(body)
            choice = obj["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            message = None
        if not isinstance(message, dict):
            self.failed = {"code": "server_error", "message": NOT_CHAT}
            self.ended = True
            return orjson.dumps(self.response("failed"))
        self.answer.take_message(message, logprobs=choice.get("logprobs"))
        self._finish = choice.get("finish_reason")
        self._usage = _usage(obj)
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
        created = b"" if self._announced else self._event(
            "response.created", response=self.response("in_progress"))  # fmt: skip
        return created + self._event("response.in_progress", response=self.response("in_progress"))

    def announce(self) -> bytes:
        """A background stream's first event, sent at once so its client has the id to resume
        with: `response.created`, `queued` (the stream's own beginning then says only
        `response.in_progress`)."""
        self._announced = True
        return self._event("response.created", response=self.response("queued"))

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
        if self.answer.oversized and not self.ended:
            too_large = "an event of the backend's stream was over 1 MiB"
            self.failed = {"code": "event_too_large", "message": too_large}
            out.append(self.finish())
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
            self._usage = _usage(obj)
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


__all__ = ["ResponseBuilder"]
