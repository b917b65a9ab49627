"""`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `DELETE /v1/conversations/{id}`:
through the official OpenAI SDK and httpx, against a stand-in, with the memory store and real
Redis; another tenant's ids are not found."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.audit import GENESIS, AuditConfig, verify
from edge.errors import ConversationNotFound
from edge.state.config import ConversationConfig
from edge.state.conversations import (
    Conversations,
    History,
    MemoryConversations,
    RedisConversations,
)
from edge.state.redis_store import RedisState
from tests.edge.conftest import Reply, TinyUpstream, client, fast_config, health_ok, run_edge
from tests.edge.state.helpers import CHAT, ChatUpstream, as_tenant, sdk_of, state, tenants
from tests.edge.test_app_sim import sim_config


def sdks(edge: Any) -> tuple[AsyncOpenAI, AsyncOpenAI]:
    """The OpenAI SDK as tenants alpha and beta (`tenants("alpha", "beta")`), retries off."""
    return sdk_of(edge, "alpha"), sdk_of(edge, "beta")


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_stored_response_reads_back_and_deleting_it_forgets_the_conversation(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                await read_back_then_delete(sdk, beta, http)


async def read_back_then_delete(sdk: AsyncOpenAI, beta: AsyncOpenAI, http: Any) -> None:
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
        await sdk.responses.create(model="default", input="more?", previous_response_id=first.id)
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
            wrong = await http.put("/v1/conversations/conv_" + "0" * 24)
            assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST, DELETE"
            wrong = await http.delete("/v1/conversations/conv_" + "0" * 24 + "/items")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
            item = await http.get("/v1/conversations/conv_x/items/more")
            assert (
                item.status_code == 404 and item.json()["error"]["code"] == "conversation_not_found"
            )
            assert (await http.get("/v1/conversations/conv_x/items/a/b")).status_code == 404
            missing = await http.post("/v1/conversations/conv_" + "0" * 24, json={"metadata": {}})
            assert missing.status_code == 404
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
    assert history.reply(1) == ({"role": "assistant", "content": "b"}, {})
    assert history.reply(2) is None
    history.append([{"role": "user", "content": "c"}], {"role": "assistant", "content": "d"},
                   {"model": "m"})  # fmt: skip
    reply = History.decode(history.encode()).reply(2)
    assert reply == ({"role": "assistant", "content": "d"}, {"model": "m"})


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
        assert await conversations.history("t", first.cid) is None
        assert not await conversations.delete("t", first.cid)
    finally:
        if redis is not None:
            await redis.aclose()


async def test_input_items_and_conversation_items_page_as_openais_lists() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                await list_items(sdk, http)


async def list_items(sdk: AsyncOpenAI, http: Any) -> None:
    first = await sdk.responses.create(
        model="default", max_output_tokens=4,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": "Name three moons."}],
    )  # fmt: skip
    second = await sdk.responses.create(
        model="default", input="And their planets?", previous_response_id=first.id,
        max_output_tokens=4,
    )  # fmt: skip
    items = [i async for i in sdk.responses.input_items.list(second.id, order="asc")]
    assert [(i.role, i.content[0].text) for i in items] == [  # type: ignore[union-attr,index]
        ("user", "And their planets?")
    ]
    items = [i async for i in sdk.responses.input_items.list(first.id, order="asc")]
    assert [(i.role, i.content[0].type) for i in items] == [  # type: ignore[union-attr,index]
        ("developer", "input_text"),  # it went upstream as `system`, and is kept as itself
        ("user", "input_text"),
    ]

    # the conversation behind them: every message, the replies as output_text
    cid = first.id[len("resp_") : len("resp_") + 24]
    conv = f"conv_{cid}"
    me = as_tenant("alpha")
    card = (await http.get(f"/v1/conversations/{conv}", headers=me)).json()
    assert card["id"] == conv and card["object"] == "conversation"
    assert abs(card["created_at"] - first.created_at) <= 1  # the same start, maybe a tick apart
    listed = (await http.get(f"/v1/conversations/{conv}/items?order=asc",
                             headers=me)).json()  # fmt: skip
    assert [i["role"] for i in listed["data"]] == [
        "developer", "user", "assistant", "user", "assistant"]  # fmt: skip
    through_sdk = [i async for i in sdk.conversations.items.list(conv, order="asc")]
    assert [i.id for i in through_sdk] == [i["id"] for i in listed["data"]]
    assert (await sdk.conversations.retrieve(conv)).id == conv
    replies = [i["content"][0] for i in listed["data"] if i["role"] == "assistant"]
    assert [r["text"] for r in replies] == [first.output_text, second.output_text]
    assert all(r["type"] == "output_text" and r["annotations"] == [] for r in replies)
    assert listed["has_more"] is False and listed["first_id"] == listed["data"][0]["id"]

    # paging: newest first by default, two at a time, then after the last one shown
    ids = [i["id"] for i in listed["data"]][::-1]
    seen: list[str] = []
    after = ""
    while True:
        query = f"?limit=2{'&after=' + after if after else ''}"
        got = (await http.get(f"/v1/conversations/{conv}/items{query}", headers=me)).json()
        seen += [i["id"] for i in got["data"]]
        if not got["has_more"]:
            break
        after = got["last_id"]
    assert seen == ids and len(set(ids)) == 5

    for query, param in (("?limit=0", "limit"), ("?limit=x", "limit"),
                         ("?order=up", "order"), ("?after=msg_nope", "after")):  # fmt: skip
        bad = await http.get(f"/v1/conversations/{conv}/items{query}", headers=me)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    theirs = await http.get(f"/v1/conversations/{conv}/items", headers=as_tenant("beta"))
    assert theirs.status_code == 404
    assert theirs.json()["error"]["code"] == "conversation_not_found"


async def test_a_conversation_created_with_items_is_continued_by_responses() -> None:
    """`conversations.create(items=...)` then `responses.create(conversation=...)`, as the OpenAI
    SDK does it: the items lead every prompt the backend gets, each turn joins the conversation."""
    upstream = ChatUpstream()
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                conv = await sdk.conversations.create(
                    items=[{"type": "message", "role": "system", "content": "Be brief."}],
                    metadata={"topic": "moons"},
                )
                assert conv.id.startswith("conv_") and conv.metadata == {"topic": "moons"}
                first = await sdk.responses.create(
                    model="default", conversation=conv.id, input="Name three moons."
                )
                second = await sdk.responses.create(
                    model="default", conversation={"id": conv.id}, input="And their planets?"
                )
                assert first.conversation is not None and first.conversation.id == conv.id
                assert (await sdk.conversations.retrieve(conv.id)).metadata == {"topic": "moons"}
                items = [i async for i in sdk.conversations.items.list(conv.id, order="asc")]
                assert [i.role for i in items] == [  # type: ignore[union-attr]
                    "system", "user", "assistant", "user", "assistant"]  # fmt: skip
                with pytest.raises(openai.NotFoundError) as theirs:
                    await beta.responses.create(model="default", conversation=conv.id, input="x")
                assert theirs.value.body["param"] == "conversation"  # type: ignore[index]
                with pytest.raises(openai.BadRequestError) as both:
                    await sdk.responses.create(
                        model="default", conversation=conv.id, previous_response_id=second.id,
                        input="x",
                    )  # fmt: skip
                assert both.value.body["param"] == "conversation"  # type: ignore[index]
            bad = await http.post("/v1/conversations", headers=as_tenant("alpha"),
                                  json={"items": [{"type": "computer_call"}]})  # fmt: skip
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "items[0]"
            bad = await http.post("/v1/conversations", headers=as_tenant("alpha"), json={"x": 1})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_parameter"
    prompts = [[m["content"] for m in b["messages"]] for b in upstream.bodies()]
    assert prompts[0] == ["Be brief.", "Name three moons."]
    assert prompts[1][0] == "Be brief." and prompts[1][1] == "Name three moons."
    assert prompts[1][-1] == "And their planets?" and len(prompts[1]) == 4


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_items_added_to_a_conversation_lead_its_next_turn(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """`conversations.items.create`, `items.retrieve` and `conversations.update` through the SDK:
    the added items reach the backend with the next turn and keep their ids once it is stored."""
    upstream = ChatUpstream()
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                conv = await sdk.conversations.create(metadata={"topic": "moons"})
                first = await sdk.responses.create(
                    model="default", conversation=conv.id, input="Name a moon."
                )
                added = await sdk.conversations.items.create(conv.id, items=[
                    {"type": "message", "role": "user", "content": "Only Jupiter's."},
                    {"type": "message", "role": "user", "content": "Keep it short."},
                ])  # fmt: skip
                ids = [i.id for i in added.data]
                assert len(ids) == 2 and added.first_id == ids[0] and added.last_id == ids[1]
                one = await sdk.conversations.items.retrieve(ids[1], conversation_id=conv.id)
                assert one.content[0].text == "Keep it short."  # type: ignore[union-attr]
                listed = [i.id async for i in sdk.conversations.items.list(conv.id, order="asc")]
                assert listed[-2:] == ids  # after the first turn, before any reply
                second = await sdk.responses.create(
                    model="default", conversation=conv.id, input="Which one?"
                )
                sent = [i async for i in sdk.responses.input_items.list(second.id, order="asc")]
                assert [i.content[0].text for i in sent] == [  # type: ignore[union-attr]
                    "Only Jupiter's.", "Keep it short.", "Which one?"]  # fmt: skip
                assert [i.id for i in sent][:2] == ids  # the same ids once the turn is stored
                updated = await sdk.conversations.update(conv.id, metadata={"topic": "jupiter"})
                assert updated.metadata == {"topic": "jupiter"}
                assert (await sdk.conversations.retrieve(conv.id)).metadata == updated.metadata
                with pytest.raises(openai.NotFoundError):
                    await beta.conversations.items.create(conv.id, items=[
                        {"type": "message", "role": "user", "content": "x"}])  # fmt: skip
                with pytest.raises(openai.NotFoundError):
                    await beta.conversations.update(conv.id, metadata={})
                with pytest.raises(openai.NotFoundError) as unknown:
                    await sdk.conversations.items.retrieve("msg_x", conversation_id=conv.id)
                assert unknown.value.body["code"] == "item_not_found"  # type: ignore[index]
                with pytest.raises(openai.BadRequestError) as empty:
                    await sdk.conversations.items.create(conv.id, items=[])
                assert empty.value.body["param"] == "items"  # type: ignore[index]
            assert first.id != second.id
            wrong = await http.put(f"/v1/conversations/{conv.id}/items/{ids[0]}",
                                   headers=as_tenant("alpha"))  # fmt: skip
            assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
    prompts = [[m["content"] for m in b["messages"]] for b in upstream.bodies()]
    assert prompts[1][-3:] == ["Only Jupiter's.", "Keep it short.", "Which one?"]


async def test_changes_to_stored_conversations_are_lines_of_the_audit_chain(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], admission=tenants("alpha"))
        audit = AuditConfig(path=str(path))
        async with run_edge(config, audit=audit) as edge, client(edge) as http:
            me = as_tenant("alpha")
            conv = (await http.post("/v1/conversations", headers=me, json={})).json()["id"]
            await http.get(f"/v1/conversations/{conv}", headers=me)  # a read: not recorded
            update = await http.post(f"/v1/conversations/{conv}", headers=me,
                                     json={"metadata": {"k": "v"}})  # fmt: skip
            assert update.status_code == 200
            added = await http.post(f"/v1/conversations/{conv}/items", headers=me, json={
                "items": [{"type": "message", "role": "user", "content": "x"}]})  # fmt: skip
            assert added.status_code == 200
            assert (await http.delete(f"/v1/conversations/{conv}", headers=me)).status_code == 200
            missing = await http.delete(f"/v1/conversations/{conv}", headers=me)
            assert missing.status_code == 404  # refused: nothing changed, nothing recorded
            log = edge.wiring.audit
            assert log is not None
            await log.flush()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["action"], r["tenant"], r["id"]) for r in records] == [
        ("stored", action, "alpha", conv)
        for action in ("conversation.create", "conversation.update", "conversation.items_add",
                       "conversation.delete")
    ]  # fmt: skip
    assert verify([str(path)], start=GENESIS).ok


async def test_a_flood_of_stored_object_calls_is_held_to_the_tenants_request_rate() -> None:
    """The stored objects' routes take from the tenant's requests bucket as inference does: a
    flood of conversation creations is refused (429, Retry-After) past the burst, and another
    tenant is untouched."""
    admission = AdmissionSettings(tenants=[
        TenantSettings(name="alpha", api_key_sha256=[key_digest("sk-alpha")],
                       requests_per_second=0.5, burst=3),
        TenantSettings(name="beta", api_key_sha256=[key_digest("sk-beta")]),
    ])  # fmt: skip
    async with TinyUpstream(ChatUpstream()) as up:
        async with (
            run_edge(fast_config([up.url], admission=admission)) as edge,
            client(edge) as http,
        ):
            created = [await http.post("/v1/conversations", headers=as_tenant("alpha"), json={})
                       for _ in range(5)]  # fmt: skip
            assert [r.status_code for r in created] == [200, 200, 200, 429, 429]
            assert int(created[3].headers["retry-after"]) >= 1
            assert created[3].json()["error"]["code"] == "rate_limit_exceeded"
            conv = created[0].json()["id"]
            read = await http.get(f"/v1/conversations/{conv}", headers=as_tenant("alpha"))
            assert read.status_code == 429  # reads too: each is a store round trip
            other = await http.post("/v1/conversations", headers=as_tenant("beta"), json={})
            assert other.status_code == 200


async def test_an_input_image_reaches_the_backend_as_a_chat_image_part() -> None:
    """A vision request through the SDK: `input_image` becomes the chat `image_url` part a
    vision model's template takes, is kept with the turn and reads back as `input_image`."""
    upstream = ChatUpstream()
    image = "data:image/png;base64,iVBORw0KGgo="
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                content: Any = [
                    {"type": "input_text", "text": "What is in it?"},
                    {"type": "input_image", "image_url": image, "detail": "low"},
                ]
                asked = await sdk.responses.create(
                    model="default", input=[{"role": "user", "content": content}]
                )
                sent = [i async for i in sdk.responses.input_items.list(asked.id)]
                parts = sent[0].content  # type: ignore[union-attr]
                assert [p.type for p in parts] == ["input_text", "input_image"]
                assert parts[1].image_url == image and parts[1].detail == "low"  # type: ignore[union-attr]
            by_file = [{"role": "user", "content": [{"type": "input_image", "file_id": "f-1"}]}]
            bad = await http.post(
                "/v1/responses", headers=as_tenant("alpha"), json={"input": by_file}
            )
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "input[0].content[0].image_url"
    assert upstream.bodies()[0]["messages"][0]["content"] == [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": image, "detail": "low"}},
    ]


async def test_added_items_are_held_to_the_conversations_size_limit() -> None:
    """Items added between turns count toward `max_bytes` as a turn's messages do: past it the
    call is a 413 and the conversation is as it was."""
    stored = state(conversations={"max_bytes": 2000, "overflow": "reject"})
    async with TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            me = as_tenant("alpha")
            conv = (await http.post("/v1/conversations", headers=me, json={})).json()["id"]
            small = [{"type": "message", "role": "user", "content": "x" * 500}]
            added = await http.post(f"/v1/conversations/{conv}/items", headers=me,
                                    json={"items": small})  # fmt: skip
            assert added.status_code == 200
            big = [{"type": "message", "role": "user", "content": "y" * 3000}]
            refused = await http.post(f"/v1/conversations/{conv}/items", headers=me,
                                      json={"items": big})  # fmt: skip
            assert refused.status_code == 413
            assert refused.json()["error"]["code"] == "conversation_too_large"
            items = (await http.get(f"/v1/conversations/{conv}/items", headers=me)).json()
            assert [i["content"][0]["text"] for i in items["data"]] == ["x" * 500]


async def test_a_client_that_leaves_mid_body_on_a_stored_route_is_counted_not_a_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with TinyUpstream(lambda r: health_ok(r) or Reply(status=404, chunked=False)) as up:
        config = fast_config([up.url], state=state())
        async with run_edge(config, listener="h1") as edge:
            host, port = edge.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            head = b"POST /v1/conversations HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
            writer.write(head + b'content-type: application/json\r\n\r\n{"it')
            await writer.drain()
            writer.close()  # gone with 90 bytes of the body still to come
            sample = 'quicedge_requests_total{model="none",route="/v1/conversations",status="499"}'

            async def counted() -> bool:
                async with httpx.AsyncClient() as http:
                    return sample + " 1.0" in (await http.get(edge.admin_url + "/metrics")).text

            deadline = asyncio.get_running_loop().time() + 10
            while not await counted():
                assert asyncio.get_running_loop().time() < deadline, "the 499 was not counted"
                await asyncio.sleep(0.05)
    # neither a fault of the edge's nor an answer missing: the client left
    assert "failed" not in caplog.text and "without a response" not in caplog.text
