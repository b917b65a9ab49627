"""A cancel that comes while a background answer is completing: the answer the cancel gave
and what the response reads afterwards agree. The worker's poll is made slow, so the answer
completes after the cancel was recorded and before the worker could read it."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, chat_whole, sdk_of, state, tenants
from tests.edge.state.test_background import settled


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_cancel_answered_cancelled_reads_cancelled_after_a_late_completion(
    store: str, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("edge.app.POLL_S", 60.0)  # the worker does not see the cancel itself
    hold = asyncio.Event()

    def reply(n: int, recorded: Recorded) -> Reply:
        assert not json.loads(recorded.body).get("stream")
        return Reply(headers=[("content-type", "application/json")],
                     chunks=[chat_whole(f"answer {n}")], chunked=False, hold=hold)  # fmt: skip

    upstream = ChatUpstream(reply)
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                queued = await sdk.responses.create(model="default", input="Hi", background=True)
                await asyncio.wait_for(upstream.arrived.wait(), 5)
                cancelled = await sdk.responses.cancel(queued.id)
                assert cancelled.status == "cancelled"
                hold.set()  # the answer completes before the worker reads the cancel
                final = await settled(sdk, queued.id)
                assert final.status == "cancelled", final.output_text
                again = await sdk.responses.retrieve(queued.id)
                assert again.status == "cancelled"
