"""How `bench.admission`'s client counts each answer, against a scripted server: an answer cut
before its stream ended is not a 200 in the statuses it reports."""

from __future__ import annotations

from bench.admission import request, summary
from tests.edge.conftest import Recorded, Reply, TinyUpstream

STREAM = [b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"]


def script(recorded: Recorded) -> Reply:
    key = recorded.headers["authorization"].removeprefix("Bearer ")
    return {
        "whole": Reply(chunks=STREAM, headers=[("content-type", "text/event-stream")]),
        "cut": Reply(chunks=STREAM, die_after=1),
    }[key]


async def test_a_stream_cut_short_is_not_counted_as_a_200() -> None:
    async with TinyUpstream(script) as server:
        port = int(server.url.rsplit(":", 1)[1])
        results = [await request(port, b"{}", key, timeout=10.0) for key in ("whole", "cut")]
    assert [r.status for r in results] == [200, 200]
    assert summary(results)["statuses"] == {"200": 1, "200 cut short": 1}
