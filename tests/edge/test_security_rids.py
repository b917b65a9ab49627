"""A request's `rid` at the backend is the edge's on every route, the routes answered in one
piece too: SGLang refuses a `rid` already in flight (400 `Duplicate request ID`), so a client's
own `rid` on an embeddings request, forwarded as sent, could collide with another tenant's
(two clients that both name theirs `batch-1`), or be chosen to refuse someone else's."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)

HEX = re.compile(r"[0-9a-f]{32}")


IN_FLIGHT: set[str] = set()


async def _answer(recorded: Recorded) -> Reply:
    """As SGLang: a `rid` already in flight is refused (each request is held a moment)."""
    reply = health_ok(recorded)
    if reply is not None:
        return reply
    rid = json.loads(recorded.body).get("rid")
    rids = [r for r in (rid if isinstance(rid, list) else [rid]) if r]
    if set(rids) & IN_FLIGHT:
        return Reply(status=400, chunks=[b'{"error": "Duplicate request ID"}'], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip
    IN_FLIGHT.update(rids)
    await asyncio.sleep(0.2)
    IN_FLIGHT.difference_update(rids)
    answer: Any = {"data": [], "object": "list", "model": "tiny-model"}
    if recorded.path in ("/tokenize", "/detokenize", "/v1/rerank"):
        answer = [] if recorded.path == "/v1/rerank" else {"tokens": [1], "text": "a"}
    return Reply(chunks=[json.dumps(answer).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": "tiny-model", "input": "hello"},
    "/v1/rerank": {"model": "tiny-model", "query": "q", "documents": ["a", "b"]},
}


@pytest.mark.parametrize("route", list(BODIES))
async def test_a_clients_rid_never_reaches_the_backend_on_a_whole_route(route: str) -> None:
    async with TinyUpstream(_answer) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            body = {**BODIES[route], "rid": "batch-1"}  # two tenants' requests, at once
            answers = await asyncio.gather(
                http.post(route, json=body), http.post(route, json=body,
                                                       headers={"x-request-id": "mine"})
            )  # fmt: skip
            assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
            batch = {**BODIES[route], "input": ["a", "b"], "rid": ["x", "y"]}
            if route == "/v1/embeddings":
                assert (await http.post(route, json=batch)).status_code == 200
            plain = await http.post(route, json=BODIES[route])
            assert plain.status_code == 200
    sent = [json.loads(r.body) for r in up.requests if r.path == route]
    rids = [s["rid"] for s in sent if "rid" in s]
    assert len(rids) == len(sent) - 1  # a body without one is forwarded as sent
    assert "rid" not in sent[-1]
    flat = [r for rid in rids for r in (rid if isinstance(rid, list) else [rid])]
    assert not {"batch-1", "mine", "x", "y"} & set(flat), flat
    assert len(set(flat)) == len(flat)
    assert all(HEX.fullmatch(r.split("-")[0]) for r in flat), flat
