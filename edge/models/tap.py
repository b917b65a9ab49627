"""The stable half of a shadow pair, read from the reply the client gets.

A request sampled for shadowing (`edge.models.shadow.Shadow.sample`) is forwarded asking for the
logprobs a comparison reads (top 5, unless the client asked for logprobs of its own, which are
then used as they are), and carries a `ShadowTap`. The tap reads the stable reply as it is
relayed: each event of a stream (it is the stream's guard, `edge.relay.Guard`, ahead of any
stream policy) or the whole JSON of an answer that is not streamed (`whole`). It keeps the text,
the finish reason, the length and each token's alternatives, and takes out of what the client
gets the logprobs the client did not ask for. Only sampled requests carry a tap; the others are
relayed as they always are.

A streamed `/generate` is not asked for logprobs: SGLang repeats them cumulatively in every
event, so a stream of n tokens would carry n²/2 positions. Its pair compares the texts, finish
reasons and lengths; the drift windows' top-1 and entropy tests see only the other routes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from edge.models.answers import (
    TOP_K,
    Answer,
    Position,
    answer_of,
    build_answer,
    chat_positions,
    completion_positions,
    generate_positions,
    with_tool_calls,
)
from edge.relay import Guard
from edge.stages.validate import CHAT, COMPLETIONS, GENERATE

SHADOWED = frozenset({CHAT, COMPLETIONS, GENERATE})
MAX_EVENT = 1024 * 1024
"""Longest incomplete event the tap holds back while stripping; past it, the tap gives up and
the rest is relayed as it comes (with its logprobs)."""
_NATIVE_LOGPROBS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
                    "output_top_logprobs")  # fmt: skip


def logprob_fields(route: str, body: Mapping[str, Any], stream: bool) -> dict[str, Any] | None:
    """What to add to a sampled request's body so that its reply carries logprobs: {} when the
    client asked for some itself (or none can be had), None when the request cannot be
    shadowed (several choices or a batch: a pair compares one answer)."""
    if (body.get("n") or 1) != 1 or isinstance(body.get("rid"), list):
        return None
    if route == CHAT:
        return {} if body.get("logprobs") else {"logprobs": True, "top_logprobs": TOP_K}
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return None  # a batch of prompts
        return {} if body.get("logprobs") is not None else {"logprobs": TOP_K}
    if (
        isinstance(body.get("text"), list)
        or isinstance(body.get("input_ids"), list)
        and (body["input_ids"] and isinstance(body["input_ids"][0], list))
    ):
        return None
    if body.get("return_logprob") or stream:
        return {}
    return {"return_logprob": True, "top_logprobs_num": TOP_K}


class ShadowTap:
    """Collects one stable reply for its shadow pair; strips logprobs the client did not ask
    for (`strip`). `inner`: the stream policy's guard, which then sees what the client would."""

    __slots__ = ("route", "strip", "inner", "failed", "finish_reason", "tokens", "events", "_tail",
                 "_texts", "_text", "_positions", "_whole", "_tools", "_generate_tops")  # fmt: skip

    def __init__(self, route: str, *, strip: bool, inner: Guard | None = None) -> None:
        self.route = route
        self.strip = strip
        self.inner = inner
        self.failed = False
        """Something in the reply could not be read (or it was an error): no pair."""
        self.finish_reason: str | None = None
        self.tokens = 0
        """Completion tokens the backend reported (0: none reported)."""
        self.events = 0
        """Events that carried text."""
        self._tail = b""
        self._texts: list[str] = []
        self._text = ""
        self._positions: list[Position] = []
        self._whole: Answer | None = None
        self._generate_tops: Any = None
        """A streamed `/generate`'s last `output_top_logprobs` (each event repeats them all)."""
        self._tools: dict[int, tuple[list[str], list[str]]] = {}
        """A streamed chat answer's tool calls by index: their name's and arguments' parts."""

    # -- the guard's side -------------------------------------------------------------------
    @property
    def cut(self) -> str | None:
        return self.inner.cut if self.inner is not None else None

    @cut.setter
    def cut(self, value: str | None) -> None:
        if self.inner is not None:
            self.inner.cut = value

    def feed(self, chunk: bytes) -> bytes:
        out = self._take(chunk)
        return self.inner.feed(out) if self.inner is not None else out

    def finish(self) -> bytes:
        """The stream's end: what the tap still holds (the inner guard's rest after it)."""
        rest, self._tail = self._tail, b""
        if rest.strip():
            self.failed = True  # an event without its blank line: the reply did not end well
        if not self.strip:
            rest = b""  # relayed as it came
        if self.inner is None:
            return rest
        return (self.inner.feed(rest) if rest else b"") + self.inner.finish()

    def _take(self, chunk: bytes) -> bytes:
        if self.failed:
            tail, self._tail = self._tail, b""
            return tail + chunk if self.strip else chunk
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_EVENT:
                self.failed = True
                self._tail = b""
                return data if self.strip else chunk
            self._tail = data
            return b"" if self.strip else chunk
        self._tail = data[end + 2 :]
        region = self._events(data[: end + 2])
        return region if self.strip else chunk

    def _events(self, region: bytes) -> bytes:
        """Read each complete event of `region` (which ends with a blank line); the region as
        the client gets it."""
        out: list[bytes] = []
        changed = False
        for event in region[:-2].split(b"\n\n"):
            if not event.startswith(b"data:") or b"\n" in event:
                out.append(event)  # comments, other fields: relayed, not read
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                out.append(event)
                continue
            try:
                obj = orjson.loads(payload)
                self._read(obj)
            except (ValueError, TypeError, KeyError, AttributeError):
                self.failed = True
                out.append(event)
                continue
            if self.strip and _strip(self.route, obj):
                event = b"data: " + orjson.dumps(obj)
                changed = True
            out.append(event)
        return b"\n\n".join(out) + b"\n\n" if changed else region

    def _read(self, obj: Any) -> None:
        if "error" in obj:
            self.failed = True
            return
        if self.route == GENERATE:  # text and logprobs are cumulative
            text = obj.get("text")
            if isinstance(text, str):
                if len(text) > len(self._text):
                    self.events += 1
                self._text = text
            meta = obj.get("meta_info") or {}
            self.tokens = int(meta.get("completion_tokens") or self.tokens)
            finish = meta.get("finish_reason")
            if isinstance(finish, dict):
                self.finish_reason = finish.get("type")
            tops = meta.get("output_top_logprobs")
            if tops:  # cumulative: all positions so far; read once, at the end (`answer`)
                self._generate_tops = tops
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.tokens = int(usage.get("completion_tokens") or self.tokens)
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if self.route == CHAT:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if delta.get("tool_calls"):
                    self._tool_deltas(delta["tool_calls"])
                self._positions += chat_positions(choice.get("logprobs"))
            else:
                text = choice.get("text")
                self._positions += completion_positions(choice.get("logprobs"))
            if isinstance(text, str) and text:
                self._texts.append(text)
                self.events += 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def _tool_deltas(self, calls: Any) -> None:
        """Parts of tool calls (`delta.tool_calls`: by index, the name once, the arguments in
        pieces); each delta that carries some counts as an event, as a text's does."""
        for call in calls:
            name, arguments = self._tools.setdefault(int(call.get("index", 0)), ([], []))
            function = call.get("function") or {}
            if function.get("name"):
                name.append(str(function["name"]))
            if function.get("arguments"):
                arguments.append(str(function["arguments"]))
        self.events += 1

    # -- an answer read whole ---------------------------------------------------------------
    def whole(self, body: bytes) -> bytes:
        """Read a non-streamed 200 answer; the body as the client gets it."""
        try:
            obj = orjson.loads(body)
            self._whole = answer_of(self.route, obj)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            self.failed = True
            return body
        if self.strip and _strip_whole(self.route, obj):
            return orjson.dumps(obj)
        return body

    def answer(self) -> Answer | None:
        """The stable answer (None: not readable, cut by a stream policy, or an error)."""
        if self.failed or self.cut is not None:
            return None
        if self._whole is not None:
            return self._whole
        text = self._text if self.route == GENERATE else "".join(self._texts)
        if self._tools:
            calls = [("".join(n), "".join(a)) for _, (n, a) in sorted(self._tools.items())]
            text = with_tool_calls(text, calls)
        try:
            if self._generate_tops is not None:
                tops, self._generate_tops = self._generate_tops, None
                self._positions = generate_positions({"output_top_logprobs": tops})
            tokens = self.tokens or len(self._positions) or self.events
            return build_answer(text, self.finish_reason, tokens, self._positions)
        except (ArithmeticError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            self.failed = True  # not what SGLang sends (read here, after the reply): no pair
            return None


def _strip(route: str, obj: Any) -> bool:
    """Take the logprobs out of one decoded event; whether anything was there."""
    if route == GENERATE:
        meta = obj.get("meta_info")
        return isinstance(meta, dict) and _pop_native(meta)
    changed = False
    for choice in obj.get("choices") or ():
        if choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


def _strip_whole(route: str, obj: Any) -> bool:
    return _strip(route, obj) if isinstance(obj, dict) else False


def _pop_native(meta: dict[str, Any]) -> bool:
    found = False
    for key in _NATIVE_LOGPROBS:
        if meta.pop(key, None) is not None:
            found = True
    return found


__all__ = ["SHADOWED", "ShadowTap", "logprob_fields"]
