"""Generated backend answers through a real edge: whatever a backend streams or answers (chunks
of any shape, any JSON in any field, split anywhere, cut short, or not JSON at all), the edge
relays or translates it without a fault of its own, and ends every request it started.

A scripted upstream answers each request as the example says, behind an edge with stored
conversations and responses, the response cache and a stream rule on: the paths that read what
a backend sends (the Responses translation, the chat answer a conversation keeps, the stream
guard, usage accounting). Requests go one at a time, so each example's answer meets its own
request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.policy.config import PolicyConfig
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.edge.fuzzing import ANY, EVENT, FUZZ, WHOLE_ANSWER, EdgeThread, split
from tests.edge.state.helpers import state


class Scripted:
    """The answer the upstream gives next, set by the test before each request."""

    def __init__(self) -> None:
        self.reply = Reply(status=503, chunked=False)
        self.edge: Any = None
        self._lock = threading.Lock()

    def set(self, reply: Reply) -> None:
        with self._lock:
            self.reply = reply

    def __call__(self, recorded: Recorded) -> Reply:
        with self._lock:
            return health_ok(recorded) or self.reply


class Faults(logging.Handler):
    """Every record logged with a traceback: a fault, wherever in the edge it happened."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[Scripted, str, Faults]]:
    upstream = Scripted()

    @contextlib.asynccontextmanager
    async def serve() -> AsyncIterator[str]:
        async with TinyUpstream(upstream) as up:
            # a backend that cuts its answers short is not ejected: every example reaches it
            config = fast_config(
                [up.url], state=state(cache={"allow_tenants": ["*"]}), eject_after_failures=10**6
            )
            policies = PolicyConfig.from_mapping(
                {"stream_rules": [{"id": "leak", "patterns": ["BEGIN PRIVATE KEY"]}]}
            )
            async with run_edge(config, listener="h1", policies=policies) as edge:
                upstream.edge = edge
                yield edge.url

    faults = Faults()
    logging.getLogger().addHandler(faults)
    try:
        with EdgeThread(serve) as edge:
            yield upstream, edge.url, faults
    finally:
        logging.getLogger().removeHandler(faults)


@pytest.fixture(scope="module")
def http(scripted: tuple[Scripted, str, Faults]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scripted[1], timeout=20.0) as client:
        yield client


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    """A backend's answer: a stream of events, a whole answer, or an error; split anywhere."""
    status = draw(st.sampled_from([200, 200, 200, 200, 400, 404, 429, 503]))
    kind = draw(st.sampled_from(["stream", "whole", "garbage"]))
    if kind == "stream":
        body = b"".join(draw(st.lists(EVENT, max_size=8)))
        content_type = "text/event-stream"
    elif kind == "whole":
        body = json.dumps(draw(WHOLE_ANSWER)).encode()
        content_type = "application/json"
    else:
        body = draw(st.one_of(st.binary(max_size=40), ANY.map(lambda v: json.dumps(v).encode())))
        content_type = draw(st.sampled_from(["application/json", "text/plain"]))
    chunks = draw(split(body))
    die = draw(st.one_of(st.none(), st.integers(0, len(chunks))))
    return Reply(status=status, headers=[("content-type", content_type)], chunks=chunks,
                 die_after=die)  # fmt: skip


_REQUESTS = st.sampled_from([
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "store": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "store": True}),
    ("/v1/responses", {"input": "hi", "stream": True}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/responses", {"input": "hi", "stream": True, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/completions", {"prompt": "hi"}),
])  # fmt: skip
"""Requests whose answers the edge reads: translated, stored, guarded or cached."""


@settings(FUZZ, max_examples=200)  # the readers themselves: `test_fuzz_answers.py`, in one process
@given(_REQUESTS, replies(), st.booleans())
def test_any_backend_answer_is_passed_on_without_a_fault(
    scripted: tuple[Scripted, str, Faults],
    http: httpx.Client,
    request_: tuple[str, dict[str, Any]],
    reply: Reply,
    in_conversation: bool,
) -> None:
    upstream, url, faults = scripted
    route, body = request_
    headers = {}
    if in_conversation and route == "/v1/chat/completions":
        headers["x-quicedge-conversation"] = "new"
    upstream.set(reply)
    response = http.post(route, json=body, headers=headers)
    assert response.status_code != 500, response.text
    backends = upstream.edge.wiring.registry.backends
    deadline = time.monotonic() + 5.0  # the edge's task may end just after the client's read
    while any(b.in_flight for b in backends) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [b.in_flight for b in backends] == [0]
    assert not faults.records, [r.getMessage() for r in faults.records]
