"""Parse stage: read the request body within a size limit, check its type, decode its JSON once."""

from __future__ import annotations

import re
from array import array
from collections.abc import Awaitable, Callable, Mapping
from itertools import accumulate
from typing import Any

import orjson

from edge.admission.headers import retry_after
from edge.errors import (
    InvalidJSON,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    UnsupportedMediaType,
)

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyBudget:
    """The bytes one process holds for bodies in transit, over all requests, and their cap:
    request bodies still arriving (`ProxyConfig.max_pending_body_bytes`) or non-streamed
    answers (`max_pending_answer_bytes`). Without it, clients that each send all but the end
    of a body just under the size limit hold that much memory until the body deadline: 100
    such uploads of 8 MB took one edge from 77 to 843 MiB (docs/errors.md, its bodies still
    arriving)."""

    __slots__ = ("held", "limit", "refusal", "what")

    def __init__(self, limit: int, what: str = "request bodies still arriving") -> None:
        self.limit = limit
        self.held = 0
        self.refusal = retry_after(1.0)
        self.what = what
        """What the bytes are, for the refusal's message."""

    def take(self, size: int) -> None:
        """Count `size` more bytes; 503 `overloaded` when they would pass the cap."""
        if self.held + size > self.limit:
            raise Overloaded(
                f"{self.what} hold the edge's {self.limit} bytes for them; retry later",
                headers=self.refusal,
            )
        self.held += size

    def give(self, size: int) -> None:
        """`size` bytes taken earlier are no longer held."""
        self.held -= size


def check_content_type(content_type: bytes | None, encoding: bytes | None = None) -> None:
    """Inference routes take `application/json` (parameters such as charset allowed), not
    compressed (RFC 9110 §8.4: 415 with `Accept-Encoding: identity`); else 415. The body is
    read and forwarded as it is, and inflating it would let a small one pass `max_body_bytes`."""
    if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding.decode('latin-1')!r} is not supported: send the body "
            "uncompressed",
            headers=((b"accept-encoding", b"identity"),),
        )
    if content_type is None:
        raise UnsupportedMediaType("Content-Type must be application/json (none given)")
    media = content_type.split(b";", 1)[0].strip().lower()
    if media != b"application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {content_type.decode('latin-1')!r}"
        )


def declared_length(value: bytes | None, limit: int) -> int | None:
    """The Content-Length header as an int; 413 at once when it already exceeds the limit."""
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        raise InvalidRequest("Content-Length is not a number") from None
    if length < 0:
        raise InvalidRequest("Content-Length is negative")
    if length > limit:
        raise PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {limit}")
    return length


async def read_body(receive: Receive, limit: int, budget: BodyBudget | None = None) -> bytes:
    """Collect `http.request` chunks, counting as they come; 413 as soon as the count passes limit.

    Nothing past the limit is kept, so a huge body costs at most `limit` bytes of memory. A
    body in several chunks also counts against `budget` until it is whole (503 past it).
    """
    first = await receive()
    if first["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = first.get("body", b"")
    if len(body) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    if not first.get("more_body", False):
        return body  # the common case: one chunk, no copy
    parts = [body]
    size = len(body)
    taken = 0
    try:
        if budget is not None:
            budget.take(size)
            taken = size
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if budget is not None:
                budget.take(len(chunk))
                taken += len(chunk)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
    finally:
        # Dropped here, not when the frame goes: a refusal's traceback keeps the frame alive.
        parts.clear()
        if budget is not None:
            budget.give(taken)


MAX_NESTING = 128
"""Levels of arrays and objects a request body may nest. The edge re-encodes bodies (a client's
`rid` replaced, an alias's pool name, a redaction, a stored turn) with orjson, which stops at
254 levels, and walks some fields recursively: a body nested deeper than that answered 500."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def too_deep(body: bytes) -> bool:
    """Whether the arrays and objects of a valid JSON text nest deeper than `MAX_NESTING`: the
    running sum of its brackets outside strings (an opening one +1, a closing one -1), found
    at C speed; a body with no more brackets than that is not scanned."""
    if body.count(b"[") + body.count(b"{") <= MAX_NESTING:
        return False
    skeleton = _STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(array("b", skeleton)), default=0) > MAX_NESTING  # signed bytes


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode the body once; 400 unless it is a JSON object.

    orjson decodes a chat request ~5x faster than `json`, and holds to RFC 8259 where `json`
    does not: UTF-8 only, no NaN or Infinity, no lone surrogate escapes, at most 1024 levels
    of nesting (`json` overflows the stack on deep nesting instead of answering 400); the edge
    takes at most `MAX_NESTING`.
    """
    if not body:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidJSON(f"request body must be a JSON object, got {type(value).__name__}")
    if too_deep(body):
        raise InvalidJSON(f"request body nests arrays and objects deeper than {MAX_NESTING} levels")
    return value
