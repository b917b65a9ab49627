"""Parse stage: read the request body within a size limit, check its type, decode its JSON once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from edge.errors import InvalidJSON, InvalidRequest, PayloadTooLarge, UnsupportedMediaType

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def check_content_type(content_type: bytes | None) -> None:
    """Inference routes take `application/json` (parameters such as charset allowed); else 415."""
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


async def read_body(receive: Receive, limit: int) -> bytes:
    """Collect `http.request` chunks, counting as they come; 413 as soon as the count passes limit.

    Nothing past the limit is kept, so a huge body costs at most `limit` bytes of memory.
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
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode the body once; 400 unless it is a JSON object.

    orjson decodes a chat request ~5x faster than `json`, and holds to RFC 8259 where `json`
    does not: UTF-8 only, no NaN or Infinity, no lone surrogate escapes, at most 1024 levels
    of nesting (`json` overflows the stack on deep nesting instead of answering 400).
    """
    if not body:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidJSON(f"request body must be a JSON object, got {type(value).__name__}")
    return value
