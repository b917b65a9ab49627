"""The memory store's bound on conversations (`memory_max_conversations`) is shared fairly:
a tenant that opens conversations without end evicts its own, never another tenant's."""

from __future__ import annotations

import pytest

from edge.state.background import MemoryEvents
from edge.state.completions import MemoryCompletions
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


async def test_stored_completions_in_memory_are_bounded_in_bytes_too() -> None:
    config = ConversationConfig(max_bytes=1024, memory_max_bytes=4096)
    store = MemoryCompletions(config)
    await store.put("a", "mine", b"m" * 100)
    for n in range(20):
        await store.put("b", f"c{n}", b"x" * 500)
    held = [blob for blob in await store.get_many("b", [f"c{n}" for n in range(20)]) if blob]
    assert await store.get("a", "mine") == b"m" * 100
    assert 0 < len(held) < 20 and 500 * len(held) + 100 <= 4096
    assert await store.get("b", "c19") is not None  # the oldest went
    assert await store.replace("b", "c19", b"y" * 10) and await store.delete("b", "c19")
    assert store._bytes == {"a": 100, "b": 500 * (len(held) - 1)}  # what it holds, counted


async def test_background_event_logs_in_memory_are_bounded_in_bytes_too() -> None:
    config = ConversationConfig(max_bytes=1024, memory_max_bytes=4096, memory_max_conversations=3)
    logs = MemoryEvents(config)
    for n in range(3):
        for at in range(3):  # a stream appends as it goes: each log grows to 1,500 bytes
            await logs.append("t", f"r{n}", [b"e" * 500], at)
    assert await logs.read("t", "r0", 0) is None  # the log written longest ago went
    assert await logs.read("t", "r1", 0) == await logs.read("t", "r2", 0) == [b"e" * 500] * 3
    for at in range(9):  # one stream past the whole budget on its own: not kept
        await logs.append("t", "huge", [b"h" * 500], at)
    assert await logs.read("t", "huge", 0) is None
    for n in range(4):  # and no more logs than memory_max_conversations
        await logs.append("u", f"s{n}", [b"s"], 0)
    assert [await logs.read("u", f"s{n}", 0) for n in range(4)] == [None, [b"s"], [b"s"], [b"s"]]
