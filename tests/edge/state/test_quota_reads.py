"""A tenant's count in Redis lives as long as what it counts: reading a conversation restarts
its TTL, and so it restarts the TTL of the tenant's share that counts it. Otherwise a tenant that
only reads for longer than `ttl` keeps its conversations while their count expires, and its
next writes start from nothing, past `tenant_max_conversations`."""

from __future__ import annotations

import asyncio

import redis.asyncio

from edge.state.config import ConversationConfig
from edge.state.conversations import Conversations, RedisConversations
from edge.state.redis_store import RedisState


async def test_a_tenant_that_only_reads_past_the_ttl_stays_within_its_bound(
    redis_url: str, redis_prefix: str
) -> None:
    config = ConversationConfig(ttl=1.0, max_bytes=1024, tenant_max_conversations=3,
                                tenant_max_bytes=6000)  # fmt: skip
    redis_state = RedisState(redis_url, timeout=1.0, prefix=redis_prefix)
    conversations = Conversations(RedisConversations(redis_state, config), config)
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        cids = []
        for n in range(3):
            turn = await conversations.start("alpha", [{"role": "user", "content": f"q{n}"}])
            assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
            cids.append(turn.cid)
        for _ in range(6):  # 1.5 s of reads only: each restarts its conversation's TTL
            for cid in cids:
                assert await conversations.history("alpha", cid) is not None
            await asyncio.sleep(0.25)
        turn = await conversations.start("alpha", [{"role": "user", "content": "one more"}])
        assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
        kept = [k async for k in r.scan_iter(match=f"{redis_prefix}conv:alpha:*")]
        assert len(kept) == 3, kept
    finally:
        await r.aclose()
        await redis_state.aclose()
