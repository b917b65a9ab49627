"""A streamed request's 200 must be an event stream. A proxy's HTML page or a JSON body in its
place was relayed as the stream, counted a success, and left the client's SDK to fail on it:
now it is a bad gateway, tried on another backend while nothing reached the client. Scripted
upstreams over real sockets, on both plain listeners (the relay starts from the read callback
on ours)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.edge.conftest import (
    LISTENERS,
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)

STREAM = {"model": "tiny-model", "prompt": "Hello", "stream": True}
PAGE = Reply(headers=[("content-type", "text/html")], chunks=[b"<html>Sign in</html>"])


def answering(reply: Reply) -> Any:
    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or reply

    return script


@LISTENERS
@pytest.mark.parametrize(
    "wrong",
    [PAGE, Reply(headers=[("content-type", "application/json")], chunks=[b'{"choices": []}'])],
    ids=["html", "json"],
)
async def test_a_stream_answered_with_no_event_stream_is_a_bad_gateway(
    listener: str, wrong: Reply
) -> None:
    async with TinyUpstream(answering(wrong)) as up:
        async with run_edge(fast_config([up.url]), listener=listener) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=STREAM)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "bad_gateway"
    assert "no event stream" in response.json()["error"]["message"]


@LISTENERS
async def test_it_is_tried_on_another_backend_first(listener: str) -> None:
    async with (
        TinyUpstream(answering(PAGE)) as page,
        TinyUpstream(answering(sse_reply(["Hi"]))) as good,
    ):
        config = fast_config([page.url, good.url], policy="round_robin")
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            for _ in range(4):  # each backend first in turn
                response = await http.post("/v1/completions", json=STREAM)
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
                assert b'"Hi"' in response.content
