"""Forward stage: the upstream request — original body bytes (with the edge's `rid`) and headers.

SGLang aborts a request by its `rid`, so the upstream `rid` is always one the edge chose
(`upstream_rid`): a client-chosen one could name another client's request, and that client's
disconnect would then abort someone else's generation; and since SGLang refuses a `rid` that is
in flight, a route answered in one piece, never aborted, gets the edge's in place of a client's
too (`whole_payload`). The client's id (its `x-request-id`, or
its body's `rid`) stays a label: the response's `x-request-id`, logs, the trace, and the upstream
`x-request-id` header, which SGLang does not read but which lets a backend's logs be joined with
the client's.

The body is forwarded as the client sent it, with `"rid"` spliced in right after the opening
brace: the body parsed as a JSON object, so its first non-blank byte is `{` and inserting one
member there keeps it valid JSON without re-serialising the rest (cheap and exact for any body
size). Only a body that carries its own `rid` is re-encoded (about 2 µs for a chat request),
with the edge's in its place: removing a member from the raw bytes would need a JSON parser.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import orjson

from edge.errors import InvalidRequest

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
_REQUEST_ID_TEXT = re.compile(r"[A-Za-z0-9._:\-]{1,128}", re.ASCII)
_WHITESPACE = b" \t\r\n"


def new_request_id() -> str:
    """A 128-bit random id in hex (as SGLang's own `uuid4().hex` rids)."""
    return os.urandom(16).hex()


def request_id_from(header: bytes | None) -> str:
    """The client's `x-request-id` if well-formed, a new one if absent; 400 if malformed.

    Restricted to a safe alphabet because it travels in a header, in JSON and in logs.
    """
    if header is None:
        return new_request_id()
    if _REQUEST_ID.fullmatch(header) is None:
        raise InvalidRequest(
            "x-request-id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="x-request-id",
            code="invalid_request_id",
        )
    return header.decode("ascii")


def label_from_body(rid: object) -> str | None:
    """A body `rid` usable as the request's label (a well-formed string), else None."""
    if isinstance(rid, str) and _REQUEST_ID_TEXT.fullmatch(rid) is not None:
        return rid
    return None


def upstream_rid(label: str, from_client: bool) -> str:
    """The `rid` the backend sees: the request id when the edge made it, else a new one."""
    return new_request_id() if from_client else label


def splice_rid(raw: bytes, body: Mapping[str, Any], rid: str) -> bytes:
    """`raw` with `"rid": rid` as its request id: added as the object's first member, or, if the
    client sent a `rid` of its own, in its place (a batch's list of rids becomes `rid-0`,
    `rid-1`, ... so that each stays the edge's)."""
    if "rid" in body:
        theirs = body["rid"]
        ours: str | list[str] = (
            [f"{rid}-{i}" for i in range(len(theirs))] if isinstance(theirs, list) else rid
        )
        return orjson.dumps({**body, "rid": ours})
    start = 0
    while raw[start] in _WHITESPACE:
        start += 1
    member = b'"rid":' + json.dumps(rid).encode()
    # `{}` gets no comma; any other object keeps its members after ours
    return raw[: start + 1] + member + (b"," if body else b"") + raw[start + 1 :]


def whole_payload(raw: bytes, body: Mapping[str, Any]) -> bytes:
    """The body of a request answered in one piece (embeddings, rerank, (de)tokenize), which
    the edge never aborts: `raw` as sent, but for a `rid` of the client's, replaced by a new
    one of the edge's (`splice_rid`). SGLang refuses a `rid` already in flight (400 `Duplicate
    request ID`) whoever sent it, so a client's own could refuse another tenant's request that
    names the same (two clients' `batch-1`), or be chosen to. A body without one gets none:
    the edge adds no field a route may not take."""
    if "rid" not in body:
        return raw
    return splice_rid(raw, body, new_request_id())


USAGE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
"""OpenAI streams, whose usage chunk comes only when asked for (`stream_options`)."""
_ASK_USAGE = b'"stream_options":{"include_usage":true}'


def ask_usage(payload: bytes, body: Mapping[str, Any]) -> bytes | None:
    """`payload` (an OpenAI streaming request) asking the backend for the stream's usage chunk,
    or None when it asks already, or when its `stream_options` is not an object (the backend's
    400 is then the client's). The client's answer goes without that chunk
    (`SSEScanner(strip_usage=True)`): the edge wants the counts for the tenant's tokens bucket,
    the audit log and the cache-hit metrics, whatever the client asked for. Spliced in after
    the opening brace as `splice_rid` does; re-encoded only when the client sent options
    without `include_usage`."""
    if "stream_options" not in body:
        start = 0
        while payload[start] in _WHITESPACE:
            start += 1
        # (a streaming request's body holds `stream` at least: never `{}`)
        return payload[: start + 1] + _ASK_USAGE + b"," + payload[start + 1 :]
    options = body["stream_options"]
    if options is None:
        options = {}
    elif not isinstance(options, dict) or options.get("include_usage", False) is not False:
        return None  # asked for already, or not ours to correct
    whole = orjson.loads(payload)
    whole["stream_options"] = {**options, "include_usage": True}
    return orjson.dumps(whole)


def upstream_headers(
    *,
    label: str,
    early_data: bool,
    traceparent: bytes | None,
    tracestate: bytes | None,
) -> list[tuple[bytes, bytes]]:
    """Headers for the backend: JSON body, the request's label as its `x-request-id` (the
    backend's `rid` is in the body), trace context, Early-Data.

    RFC 8470 §5.1: a request forwarded before the client's handshake completed carries
    `Early-Data: 1`, so the origin can answer 425 if it would not accept a replay.
    """
    headers = [(b"content-type", b"application/json"), (b"x-request-id", label.encode())]
    if traceparent is not None:
        headers.append((b"traceparent", traceparent))
        if tracestate is not None:
            headers.append((b"tracestate", tracestate))
    if early_data:
        headers.append((b"early-data", b"1"))
    return headers


# Hop-by-hop (RFC 9110 §7.6.1) and framing headers: the client's transport sets its own.
DROP_RESPONSE_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date",
     b"proxy-connection", b"upgrade", b"trailer", b"te", b"alt-svc"}
)  # fmt: skip


def response_headers(
    upstream: list[tuple[bytes, bytes]],
    *,
    request_id: str,
    backend_name: str | None,
    ratelimit: list[tuple[bytes, bytes]] | None = None,
) -> list[tuple[bytes, bytes]]:
    """The backend's response headers for the client, plus the request id, when
    `backend_name` is given (`[proxy] expose_backend_names`) the backend, and the tenant's
    rate-limit headers (`edge.admission.headers`)."""
    out = [(k, v) for k, v in upstream if k not in DROP_RESPONSE_HEADERS and k != b"x-request-id"]
    out.append((b"x-request-id", request_id.encode()))
    if backend_name is not None:
        out.append((b"x-quicedge-backend", backend_name.encode()))
    if ratelimit:
        out += ratelimit
    return out
