"""The memory store's bound on conversations (`memory_max_conversations`) is shared fairly:
a tenant that opens conversations without end evicts its own, never another tenant's."""

from __future__ import annotations

import pytest

from edge.state.config import ConversationConfig
from edge.state.conversations import Conversations, MemoryConversations
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, as_tenant, state, tenants


async def test_a_tenant_flooding_the_memory_store_evicts_its_own_conversations() -> None:
    settings = state(conversations={"memory_max_conversations": 20})
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=settings, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            alpha = as_tenant("alpha")
            mine = []
            for n in range(3):
                answer = await http.post("/v1/responses", headers=alpha, json={"input": f"a{n}"})
                assert answer.status_code == 200
                mine.append(answer.json()["id"])
            flood = []
            for n in range(40):
                answer = await http.post("/v1/responses", headers=as_tenant("beta"),
                                         json={"input": f"flood {n}"})  # fmt: skip
                assert answer.status_code == 200
                flood.append(answer.json()["id"])
            for rid in mine:
                assert (await http.get(f"/v1/responses/{rid}", headers=alpha)).status_code == 200
            beta = as_tenant("beta")
            kept = [(await http.get(f"/v1/responses/{r}", headers=beta)).status_code for r in flood]
            assert kept == [404] * 23 + [200] * 17  # its least recently used went, to fit 20


async def test_the_store_never_holds_more_than_its_bound() -> None:
    config = ConversationConfig(memory_max_conversations=10)
    store = MemoryConversations(config)
    conversations = Conversations(store, config)
    cids = {}
    for n in range(30):
        tenant = ("a", "b", "c")[n % 3]
        turn = await conversations.start(tenant, [{"role": "user", "content": f"q{n}"}])
        assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
        cids[turn.cid] = tenant
    held = [cid for cid, tenant in cids.items() if await store.load(tenant, cid) is not None]
    assert len(held) == 10
    assert sorted(sum(cids[c] == t for c in held) for t in "abc") == [3, 3, 4]  # a fair share


async def test_the_store_never_holds_more_bytes_than_its_bound() -> None:
    """A count alone let one process hold 100,000 histories of up to 2 MiB each: the bytes are
    bounded too, and the tenant filling them loses its own."""
    config = ConversationConfig(max_bytes=1024, memory_max_bytes=8192)
    store = MemoryConversations(config)
    conversations = Conversations(store, config)
    turn = await conversations.start("a", [{"role": "user", "content": "mine"}])
    assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
    kept = turn.cid
    flood = []
    for n in range(40):
        turn = await conversations.start("b", [{"role": "user", "content": f"{n} " + "x" * 700}])
        assert await conversations.commit(turn, {"role": "assistant", "content": "ok"})
        flood.append(turn.cid)
    held = [len(blob) for cid in flood if (blob := await store.load("b", cid)) is not None]
    mine = await store.load("a", kept)
    assert mine is not None
    assert 0 < len(held) < 40 and sum(held) + len(mine) <= 8192
    assert await store.load("b", flood[-1]) is not None  # the least recently used went


def test_the_byte_bound_holds_a_few_whole_conversations() -> None:
    with pytest.raises(ValueError, match="memory_max_bytes: must be at least 4 x max_bytes"):
        ConversationConfig(max_bytes=1024, memory_max_bytes=4095).validate()
