"""Background responses (`background: true`): answered `queued` at once, generated without the
client, polled with `GET /v1/responses/{id}` and stopped with `POST /v1/responses/{id}/cancel`
through any edge that shares the store. The official OpenAI SDK against real edges, a scripted
backend held at a gate, the memory store and real Redis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import redis.asyncio
from openai.types.responses import Response

from edge.state.background import END, Broadcast, MemoryEvents, RedisEvents, follow
from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState
from tests.edge.conftest import Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import (
    ChatUpstream,
    as_tenant,
    background_started,
    chat_chunks,
    default_reply,
    sdk_of,
    sse_events,
    state,
    tenants,
)
from tests.edge.state.test_conversations import metric
from tests.helpers import wait_until

DONE = frozenset({"completed", "failed", "cancelled", "incomplete"})


async def settled(sdk: openai.AsyncOpenAI, rid: str, within: float = 10.0) -> Response:
    """Poll as a client does, until the response is no longer queued or running."""
    async with asyncio.timeout(within):
        while True:
            response = await sdk.responses.retrieve(rid)
            if response.status in DONE:
                return response
            await asyncio.sleep(0.05)


async def redis_ttl_ms(url: str, key: str) -> int:
    client = redis.asyncio.Redis.from_url(url)
    try:
        return int(await client.pttl(key))
    finally:
        await client.aclose()


def stores(redis_url: str, redis_prefix: str, kind: str) -> Any:
    return state(redis_url if kind == "redis" else None, redis_prefix)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_background_response_is_polled_to_its_answer_and_continued(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stores(redis_url, redis_prefix, store),
                             admission=tenants("alpha", "beta"))  # fmt: skip
        async with run_edge(config) as edge:
            asker = sdk_of(edge)
            async with asker:
                queued = await asker.responses.create(
                    model="default", input="Name a moon.", background=True
                )
            # The client that asked is gone; the answer goes on without it.
            assert queued.status == "queued" and queued.background is True
            assert queued.output == []
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            sdk, beta = sdk_of(edge), sdk_of(edge, "beta")
            async with sdk, beta:
                running = await sdk.responses.retrieve(queued.id)
                assert running.status == "in_progress" and running.output == []
                if store == "redis":  # kept past a conversation's TTL: the longest run more
                    ttl_ms = await redis_ttl_ms(redis_url, f"{redis_prefix}bg:alpha:{queued.id}")
                    assert ttl_ms > (1800.0 + 3000.0) * 1000
                asked = [i async for i in sdk.responses.input_items.list(queued.id)]
                assert [i.content[0].text for i in asked] == ["Name a moon."]  # type: ignore[union-attr]
                with pytest.raises(openai.ConflictError):  # its conversation is busy meanwhile
                    await sdk.responses.create(
                        model="default", input="More?", previous_response_id=queued.id
                    )
                with pytest.raises(openai.NotFoundError):  # another tenant's: not found
                    await beta.responses.retrieve(queued.id)
                with pytest.raises(openai.NotFoundError):
                    await beta.responses.cancel(queued.id)
                gate.set()
                answered = await settled(sdk, queued.id)
                assert answered.status == "completed" and answered.output_text == "answer 0 done"
                assert answered.background is True and answered.created_at == queued.created_at
                kept = [i async for i in sdk.responses.input_items.list(queued.id)]
                assert [i.id for i in kept] == [i.id for i in asked]  # the same ids, stored
                follow = await sdk.responses.create(
                    model="default", input="Another?", previous_response_id=queued.id
                )
                assert follow.output_text == "answer 1 done"
                with pytest.raises(openai.BadRequestError) as stored:
                    await sdk.responses.cancel(queued.id)
                assert stored.value.body["code"] == "response_not_cancellable"  # type: ignore[index]
            line = 'quicedge_background_responses_total{outcome="completed"}'
            assert await metric(edge, line) == 1
            assert await metric(edge, "quicedge_background_responses_running") == 0
    prompts = [[m["content"] for m in b["messages"]] for b in upstream.bodies()]
    assert prompts[1] == ["Name a moon.", "answer 0 done", "Another?"]


async def test_a_cancel_through_another_edge_stops_the_answer(
    redis_url: str, redis_prefix: str
) -> None:
    """Two edges sharing Redis: the one generating the answer stops within its poll when the
    other records the cancel, and its conversation is free for the next turn at once."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    stored = stores(redis_url, redis_prefix, "redis")
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as one, run_edge(config) as two:
            first, second = sdk_of(one), sdk_of(two)
            async with first, second:
                conv = await first.conversations.create()
                queued = await first.responses.create(
                    model="default", input="Think long.", conversation=conv.id, background=True
                )
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                assert (await second.responses.retrieve(queued.id)).status == "in_progress"
                cancelled = await second.responses.cancel(queued.id)
                assert cancelled.status == "cancelled" and cancelled.output == []
                line = 'quicedge_background_responses_total{outcome="cancelled"}'
                async with asyncio.timeout(5):
                    # read as an operator reads it, from the generating edge's metrics
                    while await metric(one, line) != 1:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                # the backend's request was aborted, as a departed client's is
                await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
                again = await first.responses.cancel(queued.id)  # the same answer, twice
                assert again.status == "cancelled"
                assert (await first.responses.retrieve(queued.id)).status == "cancelled"
                upstream.gate = None
                nxt = await first.responses.create(model="default", input="Short.",
                                                   conversation=conv.id)  # fmt: skip
                assert nxt.status == "completed"
                items = [i async for i in first.conversations.items.list(conv.id, order="asc")]
                # the cancelled turn stored nothing: only the next turn's question and answer
                assert [i.role for i in items] == ["user", "assistant"]  # type: ignore[union-attr]
            assert await metric(one, "quicedge_background_responses_running") == 0
            gate.set()


async def test_a_background_answer_that_fails_or_outlives_its_edge_is_failed(
    redis_url: str, redis_prefix: str
) -> None:
    stored = stores(redis_url, redis_prefix, "redis")
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                queued = await sdk.responses.create(model="default", input="Hi",
                                                    background=True)  # fmt: skip
                await asyncio.wait_for(upstream.arrived.wait(), 5)
        # That edge stopped while the answer was running; another reads what became of it.
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                stopped = await sdk.responses.retrieve(queued.id)
                assert stopped.status == "failed" and stopped.error is not None
                assert stopped.error.code == "edge_stopped"  # type: ignore[comparison-overlap]
        gate.set()
    # No backend answers at all: the failure is recorded with the edge's error.
    config = fast_config(["http://127.0.0.1:9"], state=stored, admission=tenants("alpha"))
    async with run_edge(config, start=False) as edge:
        sdk = sdk_of(edge)
        async with sdk:
            queued = await sdk.responses.create(model="default", input="Hi", background=True)
            failed = await settled(sdk, queued.id)
            assert failed.status == "failed" and failed.error is not None
            assert failed.error.message


async def test_background_needs_store_and_stored_conversations() -> None:
    async with TinyUpstream(ChatUpstream()) as up:
        off = state(conversations={"enabled": False})
        config = fast_config([up.url], state=off, admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            me = as_tenant("alpha")
            for extra in ({"store": False}, {"stream": True}, {}):  # none kept on this edge
                body = {"input": "x", "background": True, **extra}
                refused = await http.post("/v1/responses", headers=me, json=body)
                assert refused.status_code == 400, extra
                assert refused.json()["error"]["param"] == "background"


async def test_a_drain_lets_a_background_answer_finish() -> None:
    """`settle` runs beside the listeners' drain (SIGTERM): an answer that completes within
    the drain's time is stored, where the edge's close would have failed it."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                queued = await sdk.responses.create(model="default", input="Hi", background=True)
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                await edge.wiring.settle(0.1)  # not done within it: settle only waits
                assert (await sdk.responses.retrieve(queued.id)).status == "in_progress"
                asyncio.get_running_loop().call_later(0.1, gate.set)
                await edge.wiring.settle(5.0)
                assert (await sdk.responses.retrieve(queued.id)).status == "completed"


def slow_stream(n: int, recorded: Any) -> Reply:
    """Eight tokens, 50 ms apart: time for a client to leave in the middle."""
    if not json.loads(recorded.body).get("stream"):
        return default_reply(n, recorded)
    return Reply(headers=[("content-type", "text/event-stream")],
                 chunks=chat_chunks([f"t{i} " for i in range(8)]), delay=0.05)  # fmt: skip


WHOLE = "".join(f"t{i} " for i in range(8))


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_background_stream_goes_on_when_its_client_leaves_and_resumes(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    async with TinyUpstream(ChatUpstream(slow_stream)) as up:
        config = fast_config([up.url], state=stores(redis_url, redis_prefix, store),
                             admission=tenants("alpha"))  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                seen: list[Any] = []
                stream = await sdk.responses.create(
                    model="default", input="Count.", background=True, stream=True
                )
                async for event in stream:
                    seen.append(event)
                    if sum(e.type == "response.output_text.delta" for e in seen) == 3:
                        break  # the client leaves in the middle
                await stream.close()
                rid = seen[0].response.id
                done = await settled(sdk, rid)
                assert done.status == "completed" and done.output_text == WHOLE
                last = seen[-1].sequence_number
                resumed = await sdk.responses.retrieve(rid, stream=True, starting_after=last)
                rest = [e async for e in resumed]
                numbers = [e.sequence_number for e in seen + rest]
                assert numbers == list(range(len(numbers)))  # nothing lost, nothing twice
                assert rest[-1].type == "response.completed"
                deltas = [e.delta for e in seen + rest if e.type == "response.output_text.delta"]
                assert "".join(deltas) == WHOLE
                whole = await sdk.responses.create(model="default", input="x", store=True)
            me = as_tenant("alpha")
            bad = await http.get(f"/v1/responses/{rid}?stream=true&starting_after=x", headers=me)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
            plain = await http.get(f"/v1/responses/{whole.id}?stream=true", headers=me)
            assert plain.status_code == 400 and plain.json()["error"]["code"] == "not_resumable"
            unknown = await http.get(f"/v1/responses/resp_{'0' * 32}?stream=true", headers=me)
            assert unknown.status_code == 404


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_finished_stream_resumed_past_its_end_ends_at_once(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """`starting_after` at or past the last event of a finished stream: nothing more comes,
    and the stream says so at once (it does not wait for an end the log had already)."""
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=stores(redis_url, redis_prefix, store))
        async with run_edge(config) as edge, client(edge) as http:
            body = {"input": "Hi", "background": True, "stream": True}
            whole = await http.post("/v1/responses", json=body)
            events = sse_events(whole.content)
            assert events[-1][0] == "response.completed", events
            rid, last = events[0][1]["response"]["id"], events[-1][1]["sequence_number"]
            for after in (last, last + 1, 1000):
                url = f"/v1/responses/{rid}?stream=true&starting_after={after}"
                async with asyncio.timeout(5):
                    resumed = await http.get(url)
                assert resumed.status_code == 200 and sse_events(resumed.content) == [], after


async def test_a_stream_resumed_through_another_edge_follows_it_live(
    redis_url: str, redis_prefix: str
) -> None:
    gate = asyncio.Event()
    upstream = ChatUpstream(slow_stream, gate=gate)
    stored = stores(redis_url, redis_prefix, "redis")
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as one, run_edge(config) as two:
            first, second = sdk_of(one), sdk_of(two)
            async with first, second:
                stream = await first.responses.create(
                    model="default", input="Count.", background=True, stream=True
                )
                created = await anext(aiter(stream))  # at once: the id to resume with
                assert created.type == "response.created"
                assert created.response.status == "queued"
                await stream.close()  # then gone
                rid = created.response.id
                await asyncio.wait_for(upstream.arrived.wait(), 5)

                async def resume() -> list[Any]:
                    stream = await second.responses.retrieve(rid, stream=True, starting_after=-1)
                    return [e async for e in stream]

                following = asyncio.get_running_loop().create_task(resume())
                await asyncio.sleep(0.2)  # the follower is waiting on the other edge's log
                assert not following.done()
                gate.set()
                events = await asyncio.wait_for(following, 10)
                assert [e.sequence_number for e in events] == list(range(len(events)))
                assert events[0].type == "response.created" and events[-1].type == (
                    "response.completed")  # fmt: skip
                assert events[-1].response.output_text == WHOLE


async def test_a_background_request_refused_before_it_runs_leaves_nothing_behind() -> None:
    """Refused after its turn was opened (here: a model the fleet does not serve), it frees
    its conversation at once and records nothing."""
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                conv = await sdk.conversations.create()
                with pytest.raises(openai.NotFoundError):
                    await sdk.responses.create(model="no-such-model", input="Hi",
                                               conversation=conv.id, background=True)  # fmt: skip
                after = await sdk.responses.create(model="default", input="Hi",
                                                   conversation=conv.id)  # fmt: skip
                assert after.status == "completed"  # not 409: the refused turn let go
            assert await metric(edge, "quicedge_background_responses_running") == 0
            for outcome in ("completed", "failed", "cancelled"):
                line = f'quicedge_background_responses_total{{outcome="{outcome}"}}'
                assert await metric(edge, line) == 0


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_background_answer_outlives_the_lease_by_renewing_it(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """Lease 0.3 s, an answer held 1 s: renewed every 0.1 s, its turn is still stored; a
    conversation deleted meanwhile stops the next one at its next renewal."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    url = redis_url if store == "redis" else None
    short = state(url, redis_prefix, conversations={"lease": 0.3})
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=short, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                queued = await sdk.responses.create(model="default", input="Hi", background=True)
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                asyncio.get_running_loop().call_later(1.0, gate.set)
                done = await settled(sdk, queued.id)
                assert done.status == "completed" and done.output_text == "answer 0 done"
                upstream.gate = gate = asyncio.Event()
                upstream.arrived.clear()
                again = await sdk.responses.create(model="default", input="More",
                                                   previous_response_id=queued.id,
                                                   background=True)  # fmt: skip
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                await sdk.responses.delete(queued.id)  # the whole conversation
                lost = await settled(sdk, again.id)  # stopped at its next renewal
                assert lost.status == "failed" and lost.error is not None
                assert lost.error.code == "not_stored"  # type: ignore[comparison-overlap]
                assert "deleted while the answer ran" in lost.error.message
                await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
                gate.set()
            line = 'quicedge_background_responses_total{outcome="failed"}'
            assert await metric(edge, line) == 1


def event(n: int, size: int = 100) -> bytes:
    return b"event: e\ndata: " + str(n).encode() + b"x" * size + b"\n\n"


async def test_the_event_log_and_the_asking_client_are_each_bounded() -> None:
    """Past `cap` bytes the log ends where it is (a resume gets that far); a client that lets
    `cap` bytes wait unread is ended, while one that reads gets every event."""
    log = MemoryEvents(ConversationConfig())
    reader = Broadcast(log, "t", "resp_a", cap=1000)
    mine = reader.mine()
    got = []
    for n in range(30):  # ~3 KB, read as it comes
        await reader.events(event(n))
        got.append(await anext(mine))
    await reader.close()
    assert len(got) == 30  # all of it, though the log stopped at the cap
    kept = await log.read("t", "resp_a", 0)
    assert kept is not None and kept[-1] == END and 0 < len(kept) - 1 < 30
    assert [e async for e in follow(log, "t", "resp_a", 0, within=1.0)] == kept[:-1]
    slow = Broadcast(log, "t", "resp_b", cap=1000)
    theirs = slow.mine()
    await slow.events(event(0))
    assert await anext(theirs) == event(0)
    for n in range(1, 30):  # it reads no more while these come
        await slow.events(event(n))
    rest = [e async for e in theirs]  # what waited, up to the cap; then its stream ended
    assert rest == [event(n) for n in range(1, len(rest) + 1)] and 0 < len(rest) < 29
    await slow.close()


async def test_background_answers_running_at_once_are_bounded() -> None:
    """They hold no connection, so `background_running` is what bounds them: past it, 503
    `overloaded` with Retry-After, and the refused request's conversation is free at once."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    one = state(conversations={"background_running": 1})
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=one, admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                first = await sdk.responses.create(model="default", input="A", background=True)
                conv = await sdk.conversations.create()
                body = {"input": "B", "background": True, "conversation": conv.id}
                refused = await http.post("/v1/responses", headers=as_tenant("alpha"), json=body)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "overloaded"
                assert refused.headers["retry-after"] == "1"
                gate.set()
                assert (await settled(sdk, first.id)).status == "completed"
                later = await sdk.responses.create(
                    model="default", input="B", conversation=conv.id, background=True
                )
                assert (await settled(sdk, later.id)).status == "completed"


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_stream_resumed_gives_its_own_events_not_a_deleted_one_of_the_same_id(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """A deleted background turn stores nothing: the conversation's next turn takes its
    number, so its id. Resumed, the new stream gives its own events, not the old log's."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stores(redis_url, redis_prefix, store))
        async with run_edge(config) as edge, client(edge) as http:
            conv = (await http.post("/v1/conversations", json={})).json()["id"]
            body = {"input": "A", "background": True, "stream": True, "conversation": conv}
            first = await background_started(http, body)
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            deleted = await http.delete(f"/v1/responses/{first}")
            assert deleted.json()["deleted"] is True, deleted.text
            gate.set()
            async with asyncio.timeout(5):  # its turn is free at once
                again = await http.post("/v1/responses", json={**body, "input": "B"})
            assert again.status_code == 200, again.text
            events = sse_events(again.content)
            second = events[0][1]["response"]["id"]
            url = f"/v1/responses/{second}?stream=true&starting_after=-1"
            async with asyncio.timeout(5):
                resumed = await http.get(url)
            assert first == second
            assert sse_events(resumed.content) == events, (first, second)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_deleted_stream_is_not_resumed_as_the_turn_that_took_its_id(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """A deleted background stream's events go with it: the ordinary turn that takes its id
    next keeps no event stream (400 `not_resumable`), not the deleted one's."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stores(redis_url, redis_prefix, store))
        async with run_edge(config) as edge, client(edge) as http:
            conv = (await http.post("/v1/conversations", json={})).json()["id"]
            body = {"input": "A", "background": True, "stream": True, "conversation": conv}
            first = await background_started(http, body)
            await asyncio.wait_for(upstream.arrived.wait(), 5)
            assert (await http.delete(f"/v1/responses/{first}")).status_code == 200
            gate.set()
            plain = await http.post("/v1/responses", json={"input": "B", "conversation": conv})
            assert plain.json()["id"] == first, plain.text
            resumed = await http.get(f"/v1/responses/{first}?stream=true")
            assert resumed.status_code == 400, resumed.text
            assert resumed.json()["error"]["code"] == "not_resumable"


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_an_event_log_takes_nothing_from_a_stream_it_no_longer_belongs_to(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """A deleted response still running until its edge sees the delete, and the next turn
    that took its id, write the same log: from the new stream's first event on, the log is
    the new stream's, and the old one's later events (its end among them) are not added."""
    config = ConversationConfig()
    redis_state = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    log = RedisEvents(redis_state, config) if store == "redis" else MemoryEvents(config)
    try:
        await log.append("t", "r", [b"old0", b"old1"], 0, "old")
        await log.append("t", "r", [b"new0"], 0, "new")
        await log.append("t", "r", [b"old2", END], 2, "old")
        await log.append("t", "r", [b"new1", END], 1, "new")
        assert await log.read("t", "r", 0) == [b"new0", b"new1", END]
    finally:
        await redis_state.aclose()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_background_answers_asked_at_once_stay_within_the_bound(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """Requests that come together all passed the bound before any was counted running: at
    most `background_running` of them run, the others are 503 `overloaded`."""
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    two = state(redis_url if store == "redis" else None, redis_prefix,
                conversations={"background_running": 2})  # fmt: skip
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=two)
        async with run_edge(config) as edge, client(edge) as http:
            body = {"input": "A", "background": True}
            answers = await asyncio.gather(
                *(http.post("/v1/responses", json=body) for _ in range(8))
            )
            codes = sorted(a.status_code for a in answers)
            running = await metric(edge, "quicedge_background_responses_running")
            gate.set()
            assert codes == [200, 200] + [503] * 6, codes
            assert running == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_the_queued_answer_carries_its_request_id_and_rate_limit_headers(
    stream: bool,
) -> None:
    upstream = ChatUpstream()
    admission = tenants("alpha")
    admission.tenants[0].requests_per_second = 1.0
    admission.tenants[0].burst = 5
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(), admission=admission)
        async with run_edge(config) as edge, client(edge) as http:
            request = {"model": "default", "input": "Name a moon.", "background": True,
                       "stream": stream}  # fmt: skip
            headers = {**as_tenant("alpha"), "x-request-id": "queued-0000000000000000000000001"}
            async with http.stream("POST", "/v1/responses", json=request,
                                   headers=headers) as queued:  # fmt: skip
                assert queued.status_code == 200
                assert queued.headers["x-request-id"] == headers["x-request-id"]
                assert queued.headers["x-ratelimit-limit-requests"] == "5"
                assert queued.headers["x-ratelimit-remaining-requests"] == "4"
                await queued.aread()
            # A poll takes a request from the bucket too, and says where it stands.
            rid = sse_events(queued.content)[0][1]["response"]["id"] if stream else (
                queued.json()["id"])  # fmt: skip
            polled = await http.get(f"/v1/responses/{rid}", headers=as_tenant("alpha"))
            assert polled.status_code == 200
            assert polled.headers["x-ratelimit-remaining-requests"] == "3"
