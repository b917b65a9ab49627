"""The upstream HTTP/1.1 codec on its own: bytes in, parse out, split at every offset."""

from __future__ import annotations

import httptools
import pytest

from backends.http1 import MAX_RESPONSE_HEAD, ResponseParser, encode_request

HEAD = (
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n"
)
BODY = b"4\r\nabcd\r\n1A;name=value\r\n" + b"z" * 26 + b"\r\n3\r\nxyz\r\n0\r\nt: 1\r\n\r\n"
SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
)


def parse(*parts: bytes) -> tuple[ResponseParser, bytes]:
    response = ResponseParser()
    body = b""
    for part in parts:
        response.feed(part)
        if response.body:
            body += response.take_body()
    return response, body


def splits(wire: bytes) -> list[list[bytes]]:
    """`wire` in two pieces at every offset, and one byte at a time."""
    out = [[wire[:cut], wire[cut:]] for cut in range(len(wire) + 1)]
    out.append([wire[i : i + 1] for i in range(len(wire))])
    return out


def test_chunked_response_at_every_split() -> None:
    """Status, headers (names lowercased, 1xx skipped), chunk data, extensions and trailers."""
    for parts in splits(HEAD + BODY):
        response, body = parse(*parts)
        assert body == b"abcd" + b"z" * 26 + b"xyz"
        assert response.status == 200 and response.done and response.keep_alive
        assert response.headers == [(b"transfer-encoding", b"chunked"), (b"x-a", b"1")]
        assert response.error is None and not response.extra


def test_sse_stream_at_every_split() -> None:
    for parts in splits(SSE):
        response, body = parse(*parts)
        assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert response.done and response.error is None


def test_content_length_response_at_every_split() -> None:
    wire = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nRetry-After: 1\r\n\r\nbusy"
    for parts in splits(wire):
        response, body = parse(*parts)
        assert (response.status, body, response.done) == (503, b"busy", True)
        assert response.headers == [(b"content-length", b"4"), (b"retry-after", b"1")]


def test_head_completes_before_the_body() -> None:
    response = ResponseParser()
    response.feed(SSE[: SSE.index(b"\r\n\r\n") + 4])
    assert response.head_done and response.status == 200 and not response.body
    assert not response.done


def test_bytes_after_the_end_mark_the_connection_unusable() -> None:
    response, _ = parse(HEAD + BODY + b"HTTP/1.1 200 OK\r\n")
    assert response.done and response.extra  # bytes nobody asked for: the connection is not reused


def test_reset_reads_the_next_response_on_the_connection() -> None:
    response, body = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert response.done and body == b"ok"
    response.reset()
    for part in (b"HTTP/1.1 404 Not Found\r\nContent-", b"Length: 1\r\n\r\n", b"x"):
        response.feed(part)
    assert (response.status, response.take_body(), response.done) == (404, b"x", True)


def test_connection_close_is_not_kept_alive() -> None:
    response, _ = parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert response.done and not response.keep_alive


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\ng\r\n",  # not hex
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",  # no size
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY",  # no CRLF after data
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",  # both
        b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n",  # obsolete line folding
        b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",  # NUL in a value
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n",
        b"this is not HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_RESPONSE_HEAD,  # a head that never ends
        # a head over the limit, whole in one read
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_RESPONSE_HEAD + b"\r\nContent-Length: 0\r\n\r\n",
    ],
)
def test_bad_framing_is_an_error_not_an_exception(wire: bytes) -> None:
    response, _ = parse(wire)
    assert response.error is not None and not response.done


def test_data_before_an_error_is_kept() -> None:
    response, body = parse(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n"
    )
    assert body == b"ok" and response.error is not None and not response.done


def test_body_until_close() -> None:
    """No Content-Length and not chunked: the body ends when the connection does."""
    response, body = parse(b"HTTP/1.1 200 OK\r\nX: 1\r\n\r\nab", b"c")
    assert body == b"abc" and not response.done and not response.keep_alive
    response.feed_eof()
    assert response.done
    cut, _ = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
    cut.feed_eof()
    assert not cut.done  # a declared length that never arrived is not a complete body


class _Request:
    """What a server's parser makes of an encoded request (httptools' request side)."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.body = b""
        self.complete = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete += 1


def test_encoded_request_is_one_request_at_every_split() -> None:
    body = b'{"rid":"a","stream":true}'
    wire = encode_request(
        b"10.0.0.5:30000", "POST", "/v1/chat/completions",
        [(b"content-type", b"application/json"), (b"x-request-id", b" a1 "),
         (b"Connection", b"close"), (b"content-length", b"999"), (b"host", b"evil")],
        body,
    )  # fmt: skip
    assert wire.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.5:30000\r\n")
    for parts in splits(wire):
        seen = _Request()
        parser = httptools.HttpRequestParser(seen)
        for part in parts:
            parser.feed_data(part)
        assert seen.complete == 1 and seen.url == b"/v1/chat/completions" and seen.body == body
        assert seen.headers == [
            (b"host", b"10.0.0.5:30000"),
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
            (b"x-request-id", b"a1"),
        ]


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("HEAD", "/ok", []),  # a response parser cannot frame its answer
        ("POST", "/a b", []),
        ("POST", "no-slash", []),
        ("POST", "/ok", [(b"x y", b"1")]),
        ("POST", "/ok", [(b"x", b"1\r\nx-injected: 1")]),
        ("POST", "/ok", [(b"x", b"a\x00")]),
    ],
)
def test_requests_that_could_be_misread_are_refused(
    method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> None:
    with pytest.raises(ValueError, match="invalid upstream request"):
        encode_request(b"h", method, path, headers, b"")
