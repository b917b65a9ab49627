"""`DELETE /v1/responses/{id}` of a background response that is not a stored turn yet: running
(it stops, and nothing of it is stored, even when its answer completes right after), cancelled
or failed (its record goes). The official OpenAI SDK against real edges, a scripted backend held
at a gate, the memory store and real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.edge.conftest import Recorded, Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import (
    ChatUpstream,
    as_tenant,
    default_reply,
    sdk_of,
    state,
    tenants,
)
from tests.edge.state.test_background import settled
from tests.edge.state.test_conversations import metric
from tests.helpers import wait_until

RUNNING_LINE = "quicedge_background_responses_running"


async def gone(sdk: openai.AsyncOpenAI, rid: str) -> None:
    """Every read of `rid` is a 404 `response_not_found`, and so is another delete."""
    for call in (
        sdk.responses.retrieve,
        sdk.responses.cancel,
        sdk.responses.delete,
        sdk.responses.input_items.list,
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await call(rid)  # type: ignore[operator]
        assert missing.value.body["code"] == "response_not_found", call  # type: ignore[index]


async def delete(edge: Any, rid: str) -> None:
    """`DELETE /v1/responses/{rid}` as tenant alpha: OpenAI's deletion object (the SDK's
    `responses.delete` gives back nothing to check)."""
    async with client(edge) as http:
        deleted = await http.delete(f"/v1/responses/{rid}", headers=as_tenant("alpha"))
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": rid, "object": "response", "deleted": True}


async def ended(edge: Any) -> None:
    """Until the edge generates no background answer any longer."""
    async with asyncio.timeout(10):
        while await metric(edge, RUNNING_LINE) != 0:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_deleting_a_running_background_response_stops_it_and_stores_nothing(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    gate = asyncio.Event()
    upstream = ChatUpstream(gate=gate)
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge:
            sdk, beta = sdk_of(edge), sdk_of(edge, "beta")
            async with sdk, beta:
                # A first turn, held at the backend: another tenant cannot delete it.
                queued = await sdk.responses.create(model="default", input="Think long.",
                                                    background=True)  # fmt: skip
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                with pytest.raises(openai.NotFoundError):
                    await beta.responses.delete(queued.id)
                assert (await sdk.responses.retrieve(queued.id)).status == "in_progress"
                await delete(edge, queued.id)
                await gone(sdk, queued.id)
                # It stops as a cancelled one does: the backend's request is aborted.
                await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
                await ended(edge)
                await gone(sdk, queued.id)
                with pytest.raises(openai.NotFoundError):
                    await sdk.responses.create(model="default", input="More?",
                                               previous_response_id=queued.id)  # fmt: skip

                # Deleted as its answer arrives, before the edge's next poll: it completes, and
                # is stored nowhere all the same.
                upstream.arrived.clear()
                gate.clear()
                queued = await sdk.responses.create(model="default", input="Quick one.",
                                                    background=True)  # fmt: skip
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                await delete(edge, queued.id)
                gate.set()
                await ended(edge)
                await gone(sdk, queued.id)
                line = 'quicedge_background_responses_total{outcome="completed"}'
                assert await metric(edge, line) == 0


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_deleting_a_running_later_turn_leaves_the_turns_before_it(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """A background turn of a conversation is not part of it until stored: deleting it takes
    it alone, and the conversation is free for the next turn at once."""
    gate = asyncio.Event()
    gate.set()
    upstream = ChatUpstream(gate=gate)
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                first = await sdk.responses.create(model="default", input="Name a moon.")
                gate.clear()
                upstream.arrived.clear()
                queued = await sdk.responses.create(model="default", input="Another?",
                                                    previous_response_id=first.id,
                                                    background=True)  # fmt: skip
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                await delete(edge, queued.id)
                await gone(sdk, queued.id)
                assert (await sdk.responses.retrieve(first.id)).output_text == "answer 0 done"
                gate.set()
                nxt = await sdk.responses.create(model="default", input="A third?",
                                                 previous_response_id=first.id)  # fmt: skip
                assert nxt.status == "completed"
                await ended(edge)
                # the conversation holds the first turn and the next, nothing of the deleted
                items = [i async for i in sdk.conversations.items.list(
                    "conv_" + first.id[5:29], order="asc")]  # fmt: skip
                texts = [i.content[0].text for i in items]  # type: ignore[union-attr]
                assert texts == ["Name a moon.", "answer 0 done", "A third?", "answer 2 done"]
    prompts = [[m["content"] for m in b["messages"]] for b in upstream.bodies()]
    assert prompts[2] == ["Name a moon.", "answer 0 done", "A third?"]


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_cancelled_or_failed_background_response_is_deleted(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    gate = asyncio.Event()

    def reply_for(n: int, recorded: Recorded) -> Reply:
        if n == 1:  # the second one fails at the backend
            return Reply(status=500, headers=[("content-type", "application/json")],
                         chunks=[b'{"error": "boom"}'], chunked=False)  # fmt: skip
        return default_reply(n, recorded)

    upstream = ChatUpstream(reply_for, gate=gate)
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                queued = await sdk.responses.create(model="default", input="Hi", background=True)
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                assert (await sdk.responses.cancel(queued.id)).status == "cancelled"
                await ended(edge)
                assert (await sdk.responses.retrieve(queued.id)).status == "cancelled"
                await delete(edge, queued.id)
                await gone(sdk, queued.id)

                gate.set()
                queued = await sdk.responses.create(model="default", input="Hi", background=True)
                failed = await settled(sdk, queued.id)
                assert failed.status == "failed"
                await delete(edge, queued.id)
                await gone(sdk, queued.id)
