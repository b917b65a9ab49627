"""Redis that misbehaves for a moment: a reply that comes late (a redis-server of the test's own,
paused with SIGSTOP and resumed with SIGCONT), a breaker open while a turn ends. What the edge
left in Redis meanwhile must not lock a conversation, keep a background response `in_progress`,
or cut a resumed stream; and a stored value it cannot read is a clear error, never a 500."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio

from edge.errors import StateUnavailable
from edge.state import background
from edge.state.background import BEAT_S, MemoryEvents, RedisEvents, follow
from edge.state.config import ConversationConfig
from edge.state.redis_store import FAILURES_TO_OPEN, RedisState
from tests.edge.conftest import Recorded, Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import (
    CHAT,
    ChatUpstream,
    as_tenant,
    background_started,
    chat_chunks,
    sse_events,
    state,
    tenants,
)
from tests.edge.state.test_conversations import metric
from tests.helpers import RedisServer

CONV = "x-quicedge-conversation"
USER = {"role": "user", "content": "Remember this, please."}
TIMEOUT = 0.3
"""The edges' Redis timeout here: a paused server costs that much per call."""


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which it may pause; resumed and stopped after."""
    server = RedisServer()
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """Redis stops answering (its socket still takes what is sent), then runs what it got."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def redis_of_url(url: str) -> AsyncIterator[Any]:
    """A client of the test's own, to look at (or spoil) what the edge keeps."""
    direct = redis.asyncio.Redis.from_url(url)
    try:
        yield direct
    finally:
        await direct.aclose()


def redis_of(server: RedisServer) -> contextlib.AbstractAsyncContextManager[Any]:
    return redis_of_url(server.url)


async def gone(direct: Any, key: str, within: float = 5.0) -> None:
    """Until `key` is not in Redis (AssertionError past `within` s)."""
    try:
        async with asyncio.timeout(within):
            while await direct.exists(key):  # noqa: ASYNC110  (polled from outside)
                await asyncio.sleep(0.05)
    except TimeoutError:
        ttl = await direct.pttl(key)
        raise AssertionError(f"{key} still held ({ttl} ms left)") from None


async def turn(http: httpx.AsyncClient, name: str, **extra: Any) -> httpx.Response:
    return await http.post(CHAT, headers={CONV: name}, json={"messages": [USER], **extra})


async def until_answered(http: httpx.AsyncClient, name: str, within: float = 5.0) -> None:
    """A client retrying a turn: 503 while the breaker is open is fine, a 200 must come."""
    seen: list[int] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            while (status := (await turn(http, name)).status_code) != 200:
                seen.append(status)
                await asyncio.sleep(0.1)
            return
    raise AssertionError(f"no 200 within {within} s: {seen}")


# -- leases left behind ----------------------------------------------------------------------


async def test_a_lease_whose_take_timed_out_is_released_when_redis_answers(
    own_redis: RedisServer,
) -> None:
    """Redis applied the SET NX of two turns but answered too late (503): the next turn of the
    one is answered at once, and the other's lease goes without any request (the report's
    five-minute 409)."""
    async with TinyUpstream(ChatUpstream()) as up, redis_of(own_redis) as direct:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            names = [(await turn(http, "new")).headers[CONV] for _ in range(2)]
            with paused(own_redis):
                for name in names:
                    late = await turn(http, name)
                    assert late.status_code == 503, late.text
            assert (await turn(http, names[0])).status_code == 200
            await gone(direct, f"t:conv-lease:anonymous:{names[1][len('conv_') :]}")
            assert (await turn(http, names[1])).status_code == 200


async def test_a_conversation_change_whose_take_timed_out_does_not_lock_it(
    own_redis: RedisServer,
) -> None:
    async with TinyUpstream(ChatUpstream()) as up, redis_of(own_redis) as direct:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            name = (await http.post("/v1/conversations", json={})).json()["id"]
            with paused(own_redis):
                late = await http.post(f"/v1/conversations/{name}", json={"metadata": {"a": "1"}})
                assert late.status_code == 503, late.text
            await gone(direct, f"t:conv-lease:anonymous:{name[len('conv_') :]}")
            changed = await http.post(f"/v1/conversations/{name}", json={"metadata": {"a": "2"}})
            assert changed.status_code == 200, changed.text


async def test_a_turn_whose_commit_met_an_open_breaker_frees_its_conversation(
    own_redis: RedisServer,
) -> None:
    """The answer streamed to its client while Redis was away; its commit was refused by the
    open breaker. Once Redis answers, the conversation takes its next turn."""
    gate = asyncio.Event()
    gate.set()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up, redis_of(own_redis) as direct:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            name = (await turn(http, "new")).headers[CONV]
            gate.clear()
            second = asyncio.create_task(turn(http, name, stream=True))
            async with asyncio.timeout(5):
                while len(upstream.chats) < 2:  # noqa: ASYNC110  (the turn holds its lease)
                    await asyncio.sleep(0.01)
            with paused(own_redis):
                for _ in range(FAILURES_TO_OPEN):  # the breaker opens
                    assert (await turn(http, "new")).status_code == 503
                gate.set()
                answered = await second
                assert answered.status_code == 200 and b"[DONE]" in answered.content
            await until_answered(http, name)
            async with asyncio.timeout(5):  # the leases of the turns refused meanwhile go too
                while keys := await direct.keys("t:conv-lease:*"):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert not keys


async def test_a_lease_left_behind_on_a_key_goes_before_this_edge_takes_it_again(
    redis_url: str, redis_prefix: str
) -> None:
    """The next take on the same key releases this edge's own dead lease first, in the same
    request: no wait for the background sweep."""
    store = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    key = f"{redis_prefix}conv-lease:t:c"
    try:
        assert await store.take_lease(key, b"dead", 60_000)
        store.release_soon(key, b"dead", 60_000)  # as after a reply that came too late
        assert await store.take_lease(key, b"next", 60_000)
        assert await store.client.get(key) == b"next"
        assert store.orphans == 0
        # a lease another request holds is not this edge's to free: it stays, and is busy
        store.release_soon(key, b"other", 60_000)
        assert not await store.take_lease(key, b"third", 60_000)
        assert await store.client.get(key) == b"next"
    finally:
        await store.client.delete(key)
        await store.aclose()


# -- background responses --------------------------------------------------------------------


async def response_status(http: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    answer = await http.get(f"/v1/responses/{rid}")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def test_a_background_answer_that_ends_while_redis_is_away_reads_failed_once_it_is_back(
    own_redis: RedisServer,
) -> None:
    """Its commit and its final record were refused by the open breaker: the record is
    written once Redis answers, so a client polling it stops (not `in_progress` for 1.5 h)."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            queued = await http.post("/v1/responses", json={"input": "Hi", "background": True})
            rid = queued.json()["id"]
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            with paused(own_redis):
                for _ in range(FAILURES_TO_OPEN):  # the breaker opens
                    assert (await turn(http, "new")).status_code == 503
                gate.set()
                async with asyncio.timeout(5):  # the answer ended, its record not written
                    while await metric(edge, "quicedge_background_responses_running"):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
            seen = []
            async with asyncio.timeout(5):  # a poll meets the breaker open (503) at first
                while (answer := await http.get(f"/v1/responses/{rid}")).status_code == 503 or (
                    answer.json()["status"] == "in_progress"
                ):
                    seen.append(answer.status_code)
                    await asyncio.sleep(0.1)
            body = answer.json()
            assert body["status"] == "failed", (body, seen)
            assert body["error"]["code"] == "state_unavailable", body


async def test_a_running_record_whose_heartbeat_ran_out_reads_failed(
    redis_url: str, redis_prefix: str
) -> None:
    """The edge generating a background answer keeps a heartbeat beside its record; a reader
    that finds the heartbeat gone (its edge stopped, or lost Redis) reports it failed."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(redis_url, redis_prefix))
        async with run_edge(config) as edge, client(edge) as http:
            queued = await http.post("/v1/responses", json={"input": "Hi", "background": True})
            rid = queued.json()["id"]
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            assert (await response_status(http, rid))["status"] == "in_progress"
            alive = f"{redis_prefix}bg-alive:anonymous:{rid}"
            direct = redis.asyncio.Redis.from_url(redis_url)
            try:
                assert 0 < await direct.pttl(alive) <= BEAT_S * 1000
                await direct.delete(alive)  # as when nothing renewed it for BEAT_S
            finally:
                await direct.aclose()
            body = await response_status(http, rid)
            assert body["status"] == "failed" and body["error"]["code"] == "abandoned", body
            cancel = await http.post(f"/v1/responses/{rid}/cancel")
            assert cancel.json()["status"] == "failed", cancel.text
            gate.set()


# -- resumed background streams --------------------------------------------------------------


def numbered(content: bytes) -> list[tuple[str | None, int]]:
    return [(name, data["sequence_number"]) for name, data in sse_events(content)]


async def test_a_resumed_stream_goes_on_through_a_redis_pause(own_redis: RedisServer) -> None:
    """Reads of the event log that time out (then meet the open breaker) are tried again, and
    the events the log could not take meanwhile are added once Redis answers: the resumed
    stream gets every event, in order, to the end (it was cut, and the app tried a second
    response head)."""
    texts = [f"w{n} " for n in range(24)]

    def slow(n: int, recorded: Recorded) -> Reply:
        return Reply(headers=[("content-type", "text/event-stream")], chunks=chat_chunks(texts),
                     delay=0.08)  # fmt: skip

    async with TinyUpstream(ChatUpstream(slow)) as up:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            body = {"input": "Hi", "background": True, "stream": True}
            rid = await background_started(http, body)
            pause: asyncio.Task[None] | None = None

            async def stop_a_while() -> None:
                with paused(own_redis):
                    await asyncio.sleep(0.8)

            got = b""
            url = f"/v1/responses/{rid}?stream=true&starting_after=0"
            async with http.stream("GET", url) as resumed:
                assert resumed.status_code == 200
                async for chunk in resumed.aiter_bytes():
                    got += chunk
                    if pause is None and got.count(b"event: ") >= 5:
                        pause = asyncio.create_task(stop_a_while())
            assert pause is not None
            await pause
    events = numbered(got)
    assert [n for _, n in events] == list(range(1, len(events) + 1)), events
    assert events[-1][0] == "response.completed", events[-3:]
    text = "".join(d["delta"] for n, d in sse_events(got) if n == "response.output_text.delta")
    assert text == "".join(texts)


async def test_a_resumed_stream_whose_end_the_log_never_got_ends_once_the_response_did(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream ended while Redis was away for longer than its last events are tried
    again: its log never gets its end. A stream resumed then must end (with an `error` event
    naming the last event it sent) once the response reads ended, not wait for
    `background_max` (an hour) for an end that never comes."""
    monkeypatch.setattr(background, "FLUSH_RETRIES_S", (0.05,))  # "about 2 minutes", shorter
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(own_redis.url, "t:", timeout=TIMEOUT))
        async with run_edge(config) as edge, client(edge) as http:
            body = {"input": "Hi", "background": True, "stream": True}
            rid = await background_started(http, body)
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            with paused(own_redis):
                for _ in range(FAILURES_TO_OPEN):  # the breaker opens
                    assert (await turn(http, "new")).status_code == 503
                gate.set()
                async with asyncio.timeout(5):  # the answer ended, its events not logged
                    while await metric(edge, "quicedge_background_responses_running"):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # its last events' retries ran out
            async with asyncio.timeout(5):  # the final record is written once Redis answers
                while (answer := await http.get(f"/v1/responses/{rid}")).status_code == 503 or (  # noqa: ASYNC110
                    answer.json()["status"] == "in_progress"
                ):
                    await asyncio.sleep(0.1)
            got = b""
            url = f"/v1/responses/{rid}?stream=true&starting_after=0"
            async with asyncio.timeout(10), http.stream("GET", url) as resumed:
                assert resumed.status_code == 200
                async for chunk in resumed.aiter_bytes():
                    got += chunk
    events = sse_events(got)
    assert events, got
    name, data = events[-1]
    assert name == "error" and data["code"] == "events_lost", events
    assert data["sequence_number"] == 0 + len(events) - 1, events


class FailingEvents(MemoryEvents):
    """A memory log whose reads fail (as Redis's would) once `failing` is set."""

    failing = False

    async def read(self, tenant: str, rid: str, start: int) -> list[bytes] | None:
        if self.failing:
            raise StateUnavailable("the state store did not answer (list read): TimeoutError")
        return await super().read(tenant, rid, start)


async def test_a_resumed_stream_whose_reads_keep_failing_ends_with_an_error_event() -> None:
    log = FailingEvents(ConversationConfig())
    await log.append("t", "r", [b"event: a\ndata: {}\n\n", b"event: b\ndata: {}\n\n"], 0)
    stream = follow(log, "t", "r", 1, within=60.0, patience=0.3)
    assert await anext(stream) == b"event: b\ndata: {}\n\n"
    log.failing = True
    async with asyncio.timeout(5):
        rest = [e async for e in stream]
    [(name, data)] = sse_events(b"".join(rest))
    assert name == "error" and data["type"] == "error"
    assert data["code"] == "state_unavailable" and data["sequence_number"] == 1, data
    assert "starting_after=1" in data["message"]


async def test_an_event_log_append_tried_again_adds_nothing_twice(
    redis_url: str, redis_prefix: str
) -> None:
    """A try whose answer came too late may have been applied: the next try, from the same
    place, adds only what is not there yet, so an entry's place stays its sequence number."""
    store = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    events = RedisEvents(store, ConversationConfig())
    try:
        await events.append("t", "r", [b"0", b"1"], 0)
        await events.append("t", "r", [b"0", b"1", b"2"], 0)  # the first answered late
        await events.append("t", "r", [b"3"], 3)
        await events.append("t", "r", [b"9"], 7)  # a gap: refused
        assert await events.read("t", "r", 0) == [b"0", b"1", b"2", b"3"]
    finally:
        await store.aclose()


# -- values this edge cannot read --------------------------------------------------------------


UNREADABLE = {
    "another shape": b'{"p": []}',
    "not JSON": b"\x00garbage",
    "a message not an object": b'{"p":[],"m":[1],"t":[1],"c":1}',
    "turns past the messages": b'{"p":[],"m":[{"role":"user"}],"t":[3],"c":1}',
    "a hash": None,
}


@pytest.mark.parametrize("value", list(UNREADABLE), ids=list(UNREADABLE))
async def test_a_stored_value_this_edge_cannot_read_is_a_404_never_a_500(
    value: str, redis_url: str, redis_prefix: str
) -> None:
    """Another version's format, another program's key, a partial restore: every route that
    reads the conversation answers 404 in OpenAI's shape, and Redis's breaker is not tripped
    by a key of the wrong type."""
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=state(redis_url, redis_prefix))
        async with run_edge(config) as edge, client(edge) as http:
            name = (await turn(http, "new")).headers[CONV]
            key = f"{redis_prefix}conv:anonymous:{name[len('conv_') :]}"
            async with redis_of_url(redis_url) as direct:
                await direct.delete(key)
                if UNREADABLE[value] is None:
                    await direct.hset(key, "p", "[]")
                else:
                    await direct.set(key, UNREADABLE[value])
            base = f"/v1/conversations/{name}"
            added = {"items": [{"role": "user", "content": "x"}]}
            answers = [
                await turn(http, name),
                await http.get(base),
                await http.get(base + "/items"),
                await http.post(base, json={"metadata": {"a": "b"}}),
                await http.post(base + "/items", json=added),
                await http.post("/v1/responses", json={"input": "Hi", "conversation": name}),
                await http.post("/v1/responses", json={"input": "Hi", "previous_response_id":
                                                       f"resp_{name[len('conv_') :]}00000001"}),
            ]  # fmt: skip
            for answer in answers:
                assert answer.status_code == 404, answer.text
                code = answer.json()["error"]["code"]
                assert code in ("conversation_not_found", "previous_response_not_found"), code
            assert (await turn(http, "new")).status_code == 200  # the breaker stayed closed
            assert await metric(edge, 'quicedge_redis_breaker_trips_total{store="state"}') == 0


async def test_an_unreadable_record_or_stored_completion_is_a_404(
    redis_url: str, redis_prefix: str
) -> None:
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=state(redis_url, redis_prefix),
                             admission=tenants("alpha"))  # fmt: skip
        async with run_edge(config) as edge, client(edge, headers=as_tenant("alpha")) as http:
            kept = await http.post(CHAT, json={"messages": [USER], "store": True})
            cid = kept.json()["id"]
            async with asyncio.timeout(5):  # kept after the answer went out
                while (await http.get(f"{CHAT}/{cid}")).status_code != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            rid = "resp_" + "ab" * 16
            async with redis_of_url(redis_url) as direct:
                await direct.set(f"{redis_prefix}bg:alpha:{rid}", b'{"s": 1}')
                await direct.set(f"{redis_prefix}chatcmpl:alpha:{cid}", b"[]")
            for path, code in (
                (f"/v1/responses/{rid}", "response_not_found"),
                (f"/v1/responses/{rid}/input_items", "response_not_found"),
                (f"{CHAT}/{cid}", "chat_completion_not_found"),
            ):
                answer = await http.get(path)
                assert answer.status_code == 404, answer.text
                assert answer.json()["error"]["code"] == code
            listed = await http.get(CHAT)
            assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
