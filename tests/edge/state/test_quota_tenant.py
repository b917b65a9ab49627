"""Each tenant's share of the store is bounded (`tenant_max_conversations`,
`tenant_max_bytes`), in memory and in a shared Redis: a tenant that stores without end loses
its own least recently used, never another tenant's, and Redis holds no more of it than the
bound."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio

from edge.state.completions import MemoryCompletions, RedisCompletions
from edge.state.config import ConversationConfig
from edge.state.conversations import Conversations, MemoryConversations, RedisConversations
from edge.state.redis_store import RedisState
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, as_tenant, state, tenants


async def _keys(url: str, pattern: str) -> list[bytes]:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return [k async for k in r.scan_iter(match=pattern)]
    finally:
        await r.aclose()


async def _bytes_of(url: str, keys: list[bytes]) -> int:
    r = redis.asyncio.Redis.from_url(url)
    try:
        return sum([int(await r.strlen(k)) for k in keys])
    finally:
        await r.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_tenant_storing_without_end_keeps_at_most_its_bound_and_evicts_its_own(
    kind: str, redis_url: str, redis_prefix: str
) -> None:
    config = ConversationConfig(max_bytes=1024, tenant_max_conversations=5,
                                tenant_max_bytes=6000)  # fmt: skip
    redis_state = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    store: Any = RedisConversations(redis_state, config) if kind == "redis" else (
        MemoryConversations(config))  # fmt: skip
    conversations = Conversations(store, config)
    try:
        other = await conversations.start("beta", [{"role": "user", "content": "mine"}])
        assert await conversations.commit(other, {"role": "assistant", "content": "ok"})
        cids = []
        for n in range(12):  # small ones: the count bounds them
            turn = await conversations.start("alpha", [{"role": "user", "content": f"q{n}"}])
            assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
            cids.append(turn.cid)
        # the first one read again is the most recently used: the next eviction spares it
        assert await conversations.history("alpha", cids[7]) is not None
        turn = await conversations.start("alpha", [{"role": "user", "content": "one more"}])
        assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
        held = [c for c in cids if await conversations.history("alpha", c) is not None]
        assert held == [cids[7], *cids[9:]]
        assert await conversations.history("beta", other.cid) is not None
        if kind == "redis":
            assert len(await _keys(redis_url, f"{redis_prefix}conv:alpha:*")) == 5
        big = []
        for n in range(8):  # large ones: the bytes bound them
            turn = await conversations.start("alpha", [{"role": "user", "content": "x" * 700}])
            assert await conversations.commit(turn, {"role": "assistant", "content": f"{n}"})
            big.append(turn.cid)
        held = [c for c in big if await conversations.history("alpha", c) is not None]
        assert held == big[-len(held) :] and 0 < len(held) < 8
        if kind == "redis":
            keys = await _keys(redis_url, f"{redis_prefix}conv:alpha:*")
            assert await _bytes_of(redis_url, keys) <= 6000
        assert await conversations.history("beta", other.cid) is not None
    finally:
        await redis_state.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_stored_completions_are_bounded_per_tenant(
    kind: str, redis_url: str, redis_prefix: str
) -> None:
    config = ConversationConfig(max_bytes=1024, tenant_max_conversations=4,
                                tenant_max_bytes=4096)  # fmt: skip
    redis_state = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    store: Any = RedisCompletions(redis_state, config) if kind == "redis" else (
        MemoryCompletions(config))  # fmt: skip
    try:
        await store.put("beta", "b0", b"x" * 100)
        for n in range(10):
            await store.put("alpha", f"c{n}", b"x" * 100)
        assert [await store.get("alpha", f"c{n}") is not None for n in range(10)] == (
            [False] * 6 + [True] * 4)  # fmt: skip
        for n in range(10, 20):
            await store.put("alpha", f"c{n}", b"y" * 1500)
        held = [n for n in range(20) if await store.get("alpha", f"c{n}") is not None]
        assert held == [18, 19]  # 2 x 1500 fit in 4096, 3 do not
        assert await store.newest("alpha", 10) == ["c19", "c18"]
        assert await store.get("beta", "b0") is not None
        if kind == "redis":
            assert len(await _keys(redis_url, f"{redis_prefix}chatcmpl:alpha:*")) == 2
    finally:
        await redis_state.aclose()


async def test_an_edge_on_redis_keeps_a_flooding_tenant_within_its_bound(
    redis_url: str, redis_prefix: str
) -> None:
    settings = state(redis_url, redis_prefix, conversations={"tenant_max_conversations": 3})
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=settings, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            kept = await http.post("/v1/responses", headers=as_tenant("alpha"),
                                   json={"input": "keep me"})  # fmt: skip
            assert kept.status_code == 200
            flood = []
            for n in range(6):
                answer = await http.post("/v1/responses", headers=as_tenant("beta"),
                                         json={"input": f"flood {n}"})  # fmt: skip
                assert answer.status_code == 200
                flood.append(answer.json()["id"])
            beta = as_tenant("beta")
            codes = [(await http.get(f"/v1/responses/{r}", headers=beta)).status_code
                     for r in flood]  # fmt: skip
            assert codes == [404] * 3 + [200] * 3
            mine = await http.get(f"/v1/responses/{kept.json()['id']}", headers=as_tenant("alpha"))
            assert mine.status_code == 200
    assert len(await _keys(redis_url, f"{redis_prefix}conv:beta:*")) == 3
