"""How the overload soak's client classifies each answer, against a scripted server: a 2xx
counts only with its whole stream, refusals carry their error code, and an answer that does not
end within the deadline is a miss, not a wait."""

from __future__ import annotations

import json

from bench.soak import request
from tests.edge.conftest import Recorded, Reply, TinyUpstream

STREAM = [b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"]


def error(status: int, code: str) -> Reply:
    body = json.dumps({"error": {"message": "no", "type": "x", "param": None, "code": code}})
    return Reply(status=status, chunks=[body.encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


def script(recorded: Recorded) -> Reply:
    key = recorded.headers["authorization"].removeprefix("Bearer ")
    return {
        "whole": Reply(chunks=STREAM, headers=[("content-type", "text/event-stream")]),
        "cut": Reply(chunks=STREAM, die_after=1),
        "quota": error(429, "rate_limit_exceeded"),
        "queue": error(503, "overloaded"),
        "teapot": error(418, "teapot"),
        "slow": Reply(chunks=STREAM, delay=3.0),
    }[key]


async def test_each_answer_is_classified_by_how_it_ended() -> None:
    async with TinyUpstream(script) as server:
        port = int(server.url.rsplit(":", 1)[1])
        ended = {
            key: await request(port, b"{}", key, deadline=10.0, source="127.0.0.2")
            for key in ("whole", "cut", "quota", "queue", "teapot")
        }
        slow = await request(port, b"{}", "slow", deadline=0.3)
    assert ended["whole"].outcome == "2xx" and ended["whole"].ttft is not None
    assert (ended["cut"].outcome, ended["cut"].status) == ("other", 200)
    assert (ended["quota"].outcome, ended["quota"].code) == ("429", "rate_limit_exceeded")
    assert (ended["queue"].outcome, ended["queue"].code) == ("503", "overloaded")
    assert (ended["teapot"].outcome, ended["teapot"].status) == ("other", 418)
    assert slow.outcome == "missed_deadline"
    assert {r.headers["authorization"] for r in server.requests} >= {"Bearer whole", "Bearer slow"}
