"""`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `DELETE /v1/conversations/{id}`:
through the official OpenAI SDK and httpx, against a stand-in, with the memory store and real
Redis; another tenant's ids are not found."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from backends.sim import SimServer
from edge.errors import ConversationNotFound
from edge.state.config import ConversationConfig
from edge.state.conversations import (
    Conversations,
    History,
    MemoryConversations,
    RedisConversations,
)
from edge.state.redis_store import RedisState
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.state.helpers import CHAT, as_tenant, state, tenants
from tests.edge.test_app_sim import sim_config


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_stored_response_reads_back_and_deleting_it_forgets_the_conversation(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = AsyncOpenAI(base_url=edge.url + "/v1", api_key="sk-alpha", max_retries=0)
            first = await sdk.responses.create(
                model="default", input="Name three moons.", max_output_tokens=8,
                metadata={"ticket": "42"}, store=True,
            )  # fmt: skip
            second = await sdk.responses.create(
                model="default", input="And their planets?", previous_response_id=first.id,
                max_output_tokens=8,
            )  # fmt: skip
            for made in (first, second):
                again = await sdk.responses.retrieve(made.id)
                assert again.model_dump() == made.model_dump()  # as it was answered
            assert (await sdk.responses.retrieve(first.id)).metadata == {"ticket": "42"}

            # another tenant: not found, and not deleted
            beta = AsyncOpenAI(base_url=edge.url + "/v1", api_key="sk-beta", max_retries=0)
            with pytest.raises(openai.NotFoundError) as theirs:
                await beta.responses.retrieve(first.id)
            assert theirs.value.body["code"] == "response_not_found"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                await beta.responses.delete(first.id)

            # deleting one response forgets its conversation: every turn of it
            await sdk.responses.delete(second.id)
            for gone in (first.id, second.id):
                with pytest.raises(openai.NotFoundError):
                    await sdk.responses.retrieve(gone)
            with pytest.raises(openai.NotFoundError) as cut:
                await sdk.responses.create(model="default", input="more?",
                                           previous_response_id=first.id)  # fmt: skip
            assert cut.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.delete(second.id)  # deleted already

            # a chat conversation, deleted by its conv_ id
            headers = {**as_tenant("alpha"), "x-quicedge-conversation": "new"}
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            made_chat = await http.post(CHAT, headers=headers, json=chat)
            conv = made_chat.headers["x-quicedge-conversation"]
            removed = await http.delete(f"/v1/conversations/{conv}", headers=as_tenant("alpha"))
            assert removed.status_code == 200
            assert removed.json() == {"id": conv, "object": "conversation.deleted", "deleted": True}
            resumed = await http.post(
                CHAT, headers={**as_tenant("alpha"), "x-quicedge-conversation": conv}, json=chat
            )
            assert resumed.status_code == 404


async def test_wrong_methods_and_malformed_ids() -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with run_edge(fast_config([sim.url])) as edge, client(edge) as http:
            wrong = await http.post("/v1/responses/resp_" + "0" * 32)
            assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
            wrong = await http.get("/v1/conversations/conv_" + "0" * 24)
            assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE"
            for path in ("/v1/responses/resp_nothex", "/v1/responses/x",
                         "/v1/responses/resp_" + "0" * 32):  # fmt: skip
                missing = await http.get(path)
                assert missing.status_code == 404
                assert missing.json()["error"]["code"] == "response_not_found"
            missing = await http.delete("/v1/conversations/conv_nothex")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "conversation_not_found"
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert 'route="/v1/responses/{id}"' in metrics


def test_a_history_stored_before_turns_kept_their_metadata_reads_back() -> None:
    """Blobs written before `meta` existed decode, each turn with empty metadata."""
    old = b'{"p":[],"m":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],' \
          b'"t":[2],"c":1}'  # fmt: skip
    history = History.decode(old)
    assert history.reply(1) == ("b", {})
    assert history.reply(2) is None
    history.append([{"role": "user", "content": "c"}], {"role": "assistant", "content": "d"},
                   {"model": "m"})  # fmt: skip
    assert History.decode(history.encode()).reply(2) == ("d", {"model": "m"})


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_turn_in_progress_stores_nothing_once_its_conversation_is_deleted(
    kind: str, redis_url: str, redis_prefix: str
) -> None:
    config = ConversationConfig()
    redis = RedisState(redis_url, timeout=1.0, prefix=redis_prefix) if kind == "redis" else None
    store = RedisConversations(redis, config) if redis else MemoryConversations(config)
    conversations = Conversations(store, config)
    try:
        first = await conversations.start("t", [{"role": "user", "content": "a"}])
        assert await conversations.commit(first, {"role": "assistant", "content": "b"})
        second = await conversations.resume(
            "t", first.cid, [{"role": "user", "content": "c"}],
            missing=ConversationNotFound("gone"),
        )  # fmt: skip
        assert await conversations.delete("t", first.cid)
        assert not await conversations.commit(second, {"role": "assistant", "content": "d"})
        assert await conversations.reply("t", first.cid, 1) is None
        assert not await conversations.delete("t", first.cid)
    finally:
        if redis is not None:
            await redis.aclose()
