"""The memory store's background records are shared fairly as its conversations are: a tenant
whose background responses fail without end evicts its own records, never another tenant's
running one (whose poll and cancel would then find nothing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

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
