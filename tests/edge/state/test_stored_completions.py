"""Stored chat completions (`store: true` on `/v1/chat/completions`): kept once answered,
whole or streamed, then read back, listed, given metadata and deleted through the official
OpenAI SDK; the memory store and real Redis, the stand-in as the backend."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.chat import ChatCompletion

from backends.sim import SimServer
from edge.state.conversations import CONVERSATION_HEADER as CONVERSATION
from tests.edge.conftest import Recorded, Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, as_tenant, sdk_of, state, tenants
from tests.edge.test_app_sim import sim_config


async def kept_as(sdk: openai.AsyncOpenAI, cid: str) -> ChatCompletion:
    """The stored completion `cid`: it is kept as its answer ends, just after the client has
    it, so a read that follows at once may come first (then it is read again, for 5 s)."""
    async with asyncio.timeout(5):
        while True:
            try:
                return await sdk.chat.completions.retrieve(cid)
            except openai.NotFoundError:
                await asyncio.sleep(0.05)


ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a moon."}]


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_stored_completions_read_back_list_update_and_delete(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdk_of(edge), sdk_of(edge, "beta")
            async with sdk, beta:
                whole = await sdk.chat.completions.create(
                    model="default", messages=ASK, max_tokens=6, store=True,  # type: ignore[arg-type]
                    metadata={"topic": "moons"},
                )  # fmt: skip
                kept = await kept_as(sdk, whole.id)
                assert kept.choices[0].message.content == whole.choices[0].message.content
                assert kept.usage == whole.usage and kept.metadata == {"topic": "moons"}
                # A stream is kept as the whole completion it adds up to.
                stream = await sdk.chat.completions.create(
                    model="default", messages=ASK, max_tokens=6, store=True, stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
                said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                streamed = await kept_as(sdk, chunks[0].id)
                assert streamed.choices[0].message.content == said
                assert streamed.choices[0].finish_reason == "length"
                assert streamed.usage is not None and streamed.usage.completion_tokens == 6
                assert streamed.metadata == {}
                # Not asked to be stored: not listed.
                await sdk.chat.completions.create(model="default", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
                listed = [c.id async for c in sdk.chat.completions.list()]
                assert listed == [whole.id, streamed.id]  # oldest first, as OpenAI lists them
                # newest first, a page of one at a time (the SDK follows `has_more`)
                newest = [c.id async for c in sdk.chat.completions.list(order="desc", limit=1)]
                assert newest == [streamed.id, whole.id]
                moons = [c.id async for c in sdk.chat.completions.list(metadata={"topic": "moons"})]
                assert moons == [whole.id]
                assert [c.id async for c in sdk.chat.completions.list(model="other")] == []
                sent = [m async for m in sdk.chat.completions.messages.list(whole.id)]
                assert [(m.role, m.content) for m in sent] == [  # type: ignore[union-attr]
                    ("system", "Be brief."), ("user", "Name a moon.")]  # fmt: skip
                assert sent[0].id == f"{whole.id}-0"
                updated = await sdk.chat.completions.update(whole.id, metadata={"topic": "io"})
                assert updated.metadata == {"topic": "io"}
                assert (await sdk.chat.completions.retrieve(whole.id)).metadata == {"topic": "io"}
                # Another tenant's: not found, and not in its list.
                with pytest.raises(openai.NotFoundError) as theirs:
                    await beta.chat.completions.retrieve(whole.id)
                assert theirs.value.body["code"] == "chat_completion_not_found"  # type: ignore[index]
                assert [c async for c in beta.chat.completions.list()] == []
                gone = await sdk.chat.completions.delete(whole.id)
                assert gone.deleted and gone.id == whole.id
                with pytest.raises(openai.NotFoundError):
                    await sdk.chat.completions.retrieve(whole.id)
                with pytest.raises(openai.NotFoundError):
                    await sdk.chat.completions.delete(whole.id)
                assert [c.id async for c in sdk.chat.completions.list()] == [streamed.id]
            me = as_tenant("alpha")
            bad_ones = (({"store": "yes"}, "store"), ({"store": True, "metadata": 3}, "metadata"),
                        ({"store": True, "metadata": {"k": 1}}, "metadata"))  # fmt: skip
            for bad, param in bad_ones:
                refused = await http.post("/v1/chat/completions", headers=me,
                                          json={"messages": ASK, **bad})  # fmt: skip
                assert refused.status_code == 400 and refused.json()["error"]["param"] == param
            for query, param in (("after=nope", "after"), ("limit=0", "limit"),
                                 ("order=up", "order")):  # fmt: skip
                listed = await http.get(f"/v1/chat/completions?{query}", headers=me)
                assert listed.status_code == 400 and listed.json()["error"]["param"] == param
            wrong = await http.put(f"/v1/chat/completions/{streamed.id}", headers=me)
            assert wrong.status_code == 405
            assert wrong.headers["allow"] == "GET, POST, DELETE"


async def test_without_stored_conversations_the_routes_say_so() -> None:
    async with SimServer(sim_config("b1")) as sim:
        off = state(conversations={"enabled": False})
        config = fast_config([sim.url], state=off, admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            listed = await http.get("/v1/chat/completions", headers=as_tenant("alpha"))
            assert listed.status_code == 400
            assert listed.json()["error"]["code"] == "conversations_disabled"


async def test_clients_without_an_api_key_cannot_list_each_others_completions() -> None:
    """Every key-less client is the tenant `anonymous`: a list would give each of them the
    others' stored completions, prompts included. It is a 401; by its id, a client still reads
    the completion it was answered."""
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=state())) as edge, client(edge) as http:
            asked = await http.post("/v1/chat/completions", json={"messages": ASK, "store": True})
            assert asked.status_code == 200
            cid = asked.json()["id"]
            async with asyncio.timeout(5):  # kept just after the client has its answer
                while True:
                    kept = await http.get(f"/v1/chat/completions/{cid}")
                    if kept.status_code != 404:
                        break
                    await asyncio.sleep(0.05)
            assert kept.json()["choices"][0]["message"]["content"] == "answer 0 done"
            listed = await http.get("/v1/chat/completions")
            assert listed.status_code == 401, listed.text
            assert listed.json()["error"]["code"] == "invalid_api_key"
            assert "anonymous" in listed.json()["error"]["message"]
            assert "Name a moon" not in listed.text


def two_choices(recorded: Recorded) -> Reply:
    """SGLang's stream for `n: 2`: each choice in chunks of its own, by `index`, interleaved;
    and one chunk of an index past `MAX_CHOICES`, which is not kept."""
    head = {"id": "chatcmpl-n2", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    steps = [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant"}, None),
             (0, {"content": "Io"}, None), (1, {"content": "Europa"}, None),
             (1, {"content": " too"}, None), (1000, {"content": "past the bound"}, None),
             (0, {}, "stop"), (1, {}, "length")]  # fmt: skip
    chunks = [
        b"data: " + json.dumps({**head, "choices": [
            {"index": i, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"
        for i, delta, finish in steps
    ]  # fmt: skip
    return Reply(headers=[("content-type", "text/event-stream")],
                 chunks=[*chunks, b"data: [DONE]\n\n"])  # fmt: skip


async def test_a_stream_of_two_choices_is_kept_with_both_and_a_conversation_keeps_the_first() -> (
    None
):
    upstream = ChatUpstream(lambda n, recorded: two_choices(recorded))
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                stream = await sdk.chat.completions.create(
                    model="default", messages=ASK, n=2, store=True, stream=True,  # type: ignore[arg-type]
                )  # fmt: skip
                chunks = [c async for c in stream]
                kept = await kept_as(sdk, chunks[0].id)
            assert [(c.index, c.message.content, c.finish_reason) for c in kept.choices] == [
                (0, "Io", "stop"), (1, "Europa too", "length")]  # fmt: skip
            # A conversation's turn holds one answer: the first choice, never the two mixed.
            first = await http.post(
                "/v1/chat/completions", headers={**as_tenant("alpha"), CONVERSATION: "new"},
                json={"messages": ASK, "n": 2, "stream": True},
            )  # fmt: skip
            assert first.status_code == 200
            again = await http.post(
                "/v1/chat/completions",
                headers={**as_tenant("alpha"), CONVERSATION: first.headers[CONVERSATION]},
                json={"messages": [{"role": "user", "content": "And another?"}]},
            )  # fmt: skip
            assert again.status_code == 200
    history = upstream.bodies()[-1]["messages"]
    assert history[2] == {"role": "assistant", "content": "Io"}
