"""A chat completion's answer built up from its stream: the text, the tool calls, the finish.

`ChatAnswer` reads an OpenAI chat stream (`feed`: the complete SSE events' payloads, parsed)
and its deltas (`take`), or a whole `chat.completion` message (`take_message`), and gives the
assistant message a stored conversation keeps (`reply`). The Responses translation
(`ResponseBuilder`) turns each change it reports into events; a chat conversation that offers
tools keeps the reply with its calls. A text-only chat conversation does not need it: the relay's
scanner already has the text, for less.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from edge.state.conversations import REMOVED
from edge.state.response_tools import calls_of


@dataclass(slots=True, eq=False)
class Call:
    """One tool call of the answer, as it streams in (compared by identity: two calls may be
    alike)."""

    item_id: str
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def chat(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}  # fmt: skip


MAX_EVENT_BYTES = 1 << 20
"""An SSE event longer than this (1 MiB) is not parsed: the answer is marked `oversized`."""

MESSAGE = "message"
"""The place of the text among the answer's parts (`ChatAnswer.parts`)."""
REASONING = "reasoning"
"""The place of a reasoning model's thinking (`reasoning_content`) among them."""

Change = tuple[str, Any, str]
"""What one delta did: (`"text"`, its tokens' logprobs or None, the text), (`"reasoning"`, None,
the thinking) or
(`"call"`, the Call, its new arguments), after an (`"open"`, MESSAGE, REASONING or the Call,
"") when it began a part."""


class ChatAnswer:
    """One answer's text and tool calls, in the order they began (`parts`)."""

    def __init__(self, call_id: Callable[[int], str] = lambda index: f"fc_{index}") -> None:
        self._call_id = call_id
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.logprobs: list[Any] = []
        """The text's tokens with their logprobs, when the request asked for them."""
        self.parts: list[Call | str] = []
        self._calls: dict[int, Call] = {}
        self._buffer = b""
        self.finish: str | None = None
        """The upstream `finish_reason`, once given."""
        self.done = False
        """`data: [DONE]` was read."""
        self.oversized = False
        """An event passed `MAX_EVENT_BYTES`: what follows is not parsed (the answer is not
        whole)."""

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        """The thinking a reasoning model sent before its answer (never stored: a model is
        given its earlier answers without it)."""
        return "".join(self._reasoning)

    def index(self, part: Call | str) -> int:
        """The place of `part` among the parts (its output index)."""
        return next(i for i, p in enumerate(self.parts) if p is part or p == part)

    @property
    def calls(self) -> list[Call]:
        return [part for part in self.parts if isinstance(part, Call)]

    def reply(self) -> dict[str, Any]:
        """The answer as the chat assistant message a conversation stores."""
        calls = [call.chat() for call in self.calls]
        if not calls:
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": self.text or None, "tool_calls": calls}

    # -- a stream ---------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> list[Any]:
        """The payloads of the SSE events `chunk` completes: a parsed JSON value each, or the
        bytes `b"[DONE]"` (which also sets `done`); an unparseable one is skipped."""
        if self.oversized:
            return []
        data = self._buffer + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_EVENT_BYTES:  # bounded: a backend's runaway event is not kept
                self._buffer, self.oversized = b"", True
                return []
            self._buffer = data
            return []
        self._buffer = data[end + 2 :]
        out: list[Any] = []
        for event in data[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    out.append(payload)
                    continue
                try:
                    out.append(orjson.loads(payload))
                except ValueError:
                    continue
        return out

    def take_chunk(self, obj: Any, index: int = 0) -> list[Change]:
        """A `chat.completion.chunk`'s choice `index`: its finish and its delta. With `n` > 1
        a backend streams each choice in chunks of its own, told apart by their `index`."""
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list):
            return []
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == index:
                return self.take_choice(choice)
        return []

    def take_choice(self, choice: dict[str, Any]) -> list[Change]:
        """One streamed choice of this answer: its finish and its delta."""
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        changes = self.take(delta)
        lps = choice.get("logprobs")
        tokens = lps.get("content") if isinstance(lps, dict) else None
        if isinstance(tokens, list) and tokens:
            self.logprobs += tokens
            # the text change carries its tokens' logprobs (the Responses delta event has them)
            changes = [("text", tokens, c[2]) if c[0] == "text" else c for c in changes]
        return changes

    def take(self, delta: dict[str, Any]) -> list[Change]:
        """One delta's text and tool-call pieces."""
        changes: list[Change] = []
        thinking = delta.get("reasoning_content")
        if isinstance(thinking, str) and thinking:
            if REASONING not in self.parts:
                self.parts.append(REASONING)
                changes.append(("open", REASONING, ""))
            self._reasoning.append(thinking)
            changes.append(("reasoning", None, thinking))
        text = delta.get("content")
        if isinstance(text, str) and text:
            if MESSAGE not in self.parts:
                self.parts.append(MESSAGE)
                changes.append(("open", MESSAGE, ""))
            self._text.append(text)
            changes.append(("text", None, text))
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for piece in calls:
                if isinstance(piece, dict):
                    self._take_call(piece, changes)
        return changes

    def _take_call(self, piece: dict[str, Any], changes: list[Change]) -> None:
        raw_index, raw_function = piece.get("index"), piece.get("function")
        index = raw_index if isinstance(raw_index, int) else 0
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = Call(self._call_id(index), str(piece.get("id") or ""),
                                             str(function.get("name") or ""))  # fmt: skip
            self.parts.append(call)
            changes.append(("open", call, ""))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.arguments.append(arguments)
            changes.append(("call", call, arguments))

    # -- a whole answer ---------------------------------------------------------------------

    def take_message(self, message: Any, ids: Any = None, logprobs: Any = None) -> None:
        """A whole chat message: its text, then its calls (`ids`: their item ids, if kept)."""
        if isinstance(message, dict) and message.get(REMOVED):
            return  # taken out of its conversation: nothing of it is shown
        text = message.get("content") if isinstance(message, dict) else None
        calls = calls_of(message) if isinstance(message, dict) else []
        thinking = message.get("reasoning_content") if isinstance(message, dict) else None
        if isinstance(thinking, str) and thinking:
            self._reasoning = [thinking]
            self.parts.append(REASONING)
        self._text = [text] if isinstance(text, str) else []
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        self.logprobs = list(tokens) if isinstance(tokens, list) else []
        if self.text or not calls:
            self.parts.append(MESSAGE)
        for k, raw in enumerate(calls):
            if raw.get(REMOVED):  # taken out of its conversation since (ids by place stay)
                continue
            function = raw["function"]
            item_id = ids[k] if isinstance(ids, list) and k < len(ids) else self._call_id(k)
            call = Call(item_id, str(raw.get("id") or ""), str(function.get("name") or ""),
                        [str(function.get("arguments") or "")])  # fmt: skip
            self._calls[k] = call
            self.parts.append(call)


def message_of_body(body: bytes) -> dict[str, Any] | None:
    """The assistant message of a whole `chat.completion` body (None when it has none)."""
    try:
        message = orjson.loads(body)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return message if isinstance(message, dict) else None


__all__ = ["MESSAGE", "REASONING", "Call", "ChatAnswer", "Change", "message_of_body"]
