"""The memory store's background records are shared fairly as its conversations are: a tenant
whose background responses fail without end evicts its own records, never another tenant's
running one (whose poll and cancel would then find nothing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from edge.state.background import FAILED, RUNNING, Record, RedisRecords
from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.edge.state.helpers import default_reply, sdk_of, state, tenants
from tests.edge.state.test_background import settled


async def test_a_tenant_failing_background_responses_does_not_evict_another_tenants() -> None:
    gate = asyncio.Event()

    async def reply(recorded: Recorded) -> Reply:
        if "flood" in json.loads(recorded.body)["messages"][-1]["content"]:
            refused = {"object": "error", "message": "no", "type": "BadRequestError",
                       "param": None, "code": 400}  # fmt: skip
            return Reply(status=400, headers=[("content-type", "application/json")],
                         chunks=[json.dumps(refused).encode()], chunked=False)  # fmt: skip
        await gate.wait()
        return default_reply(0, recorded)

    settings = state(conversations={"memory_max_conversations": 10})
    async with TinyUpstream(_Script(reply)) as up:
        config = fast_config([up.url], state=settings, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge:
            alpha, beta = sdk_of(edge), sdk_of(edge, "beta")
            async with alpha, beta:
                mine = await alpha.responses.create(model="default", input="Think.",
                                                    background=True)  # fmt: skip
                for n in range(15):
                    failed = await beta.responses.create(model="default", input=f"flood {n}",
                                                         background=True)  # fmt: skip
                    assert (await settled(beta, failed.id)).status == "failed"
                running = await alpha.responses.retrieve(mine.id)
                assert running.status == "in_progress"
                gate.set()
                assert (await settled(alpha, mine.id)).status == "completed"


class _Script:
    """The health answers, then `reply` for every chat request."""

    def __init__(self, reply: Callable[[Recorded], Awaitable[Reply]]) -> None:
        self.reply = reply

    async def __call__(self, recorded: Recorded) -> Reply:
        found = health_ok(recorded)
        if found is not None:
            return found
        return await self.reply(recorded)


async def test_redis_keeps_each_tenants_background_records_within_its_bound(
    redis_url: str, redis_prefix: str
) -> None:
    """A failed record keeps what its turn sent (up to `max_bytes`) for `ttl` +
    `background_max`: unbounded, a tenant failing responses without end filled Redis."""
    config = ConversationConfig(max_bytes=1024, tenant_max_conversations=3,
                                tenant_max_bytes=8192)  # fmt: skip
    redis_state = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    records = RedisRecords(redis_state, config)
    try:
        await records.start("alpha", "resp_a", Record(RUNNING, {}))
        for n in range(6):
            await records.start("beta", f"resp_{n}", Record(RUNNING, {}))
            failed = Record(FAILED, {}, {"code": "x", "message": "y"}, [["0", {"c": "z" * 1000}]])
            assert await records.settle("beta", f"resp_{n}", failed)
        kept = [n for n in range(6) if await records.get("beta", f"resp_{n}") is not None]
        assert kept == [3, 4, 5]
        for n in range(6, 20):  # the bytes bound them too: 8 x 1 KiB do not fit in 8 KiB
            await records.put("beta", f"resp_{n}", Record(FAILED, {}, None, [["0", "z" * 3000]]))
        kept = [n for n in range(20) if await records.get("beta", f"resp_{n}") is not None]
        assert kept == [18, 19]
        assert await records.get("alpha", "resp_a") is not None
        await records.delete("beta", "resp_19")
        assert await records.get("beta", "resp_19") is None
    finally:
        await redis_state.aclose()
