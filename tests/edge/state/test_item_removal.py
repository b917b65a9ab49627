"""`DELETE /v1/conversations/{id}/items/{item_id}` (`client.conversations.items.delete`): the item
leaves the conversation's lists and every later prompt, and every other item keeps its id. The
official OpenAI SDK against the edge, the memory store and real Redis."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from backends.sim import SimServer
from edge.state.conversations import History
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, as_tenant, sdk_of, state, tenants
from tests.edge.state.test_function_calls import WEATHER
from tests.edge.state.test_stored_objects import sdks
from tests.edge.test_app_sim import sim_config


async def item_ids(sdk: openai.AsyncOpenAI, conv: str) -> list[str]:
    return [i.id async for i in sdk.conversations.items.list(conv, order="asc")]


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_removed_item_leaves_the_lists_and_later_prompts(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    upstream = ChatUpstream()
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk, beta = sdks(edge)
            async with sdk, beta:
                conv = await sdk.conversations.create(
                    items=[{"type": "message", "role": "system", "content": "Be brief."}]
                )
                first = await sdk.responses.create(
                    model="default", conversation=conv.id, input="Name a moon."
                )
                added = await sdk.conversations.items.create(conv.id, items=[
                    {"type": "message", "role": "user", "content": "Only Jupiter's."},
                    {"type": "message", "role": "user", "content": "Keep it short."},
                ])  # fmt: skip
                before = await item_ids(sdk, conv.id)
                # An item added since the last turn: gone before the next turn sends it.
                kept = await sdk.conversations.items.delete(added.data[0].id,
                                                            conversation_id=conv.id)  # fmt: skip
                assert kept.id == conv.id and kept.object == "conversation"
                after = await item_ids(sdk, conv.id)
                assert after == [i for i in before if i != added.data[0].id]
                with pytest.raises(openai.NotFoundError) as gone:
                    await sdk.conversations.items.retrieve(added.data[0].id,
                                                           conversation_id=conv.id)  # fmt: skip
                assert gone.value.body["code"] == "item_not_found"  # type: ignore[index]
                with pytest.raises(openai.NotFoundError) as twice:
                    await sdk.conversations.items.delete(added.data[0].id,
                                                         conversation_id=conv.id)  # fmt: skip
                assert twice.value.body["code"] == "item_not_found"  # type: ignore[index]
                second = await sdk.responses.create(
                    model="default", conversation=conv.id, input="Which one?"
                )
                # The added item that stayed is stored with the turn, under the same id.
                assert (await item_ids(sdk, conv.id))[: len(after)] == after
                # A stored turn's question and reply: out of the next prompt, and the reply out
                # of its response object too.
                question, reply = before[1], first.output[0].id  # the reply by its response's id
                listed = await sdk.conversations.items.retrieve(reply, conversation_id=conv.id)
                assert listed.id == before[2]  # which the conversation lists it under
                for item in (question, reply):
                    await sdk.conversations.items.delete(item, conversation_id=conv.id)
                emptied = await sdk.responses.retrieve(first.id)  # its text is gone
                assert [o.type for o in emptied.output] == ["message"]
                assert emptied.output_text == ""
                assert (await sdk.responses.retrieve(second.id)).output_text
                await sdk.responses.create(model="default", conversation=conv.id, input="Why?")
                with pytest.raises(openai.NotFoundError):  # another tenant's: not found
                    await beta.conversations.items.delete(before[4], conversation_id=conv.id)
                with pytest.raises(openai.NotFoundError) as unknown:
                    await sdk.conversations.items.delete("msg_x", conversation_id=conv.id)
                assert unknown.value.body["code"] == "item_not_found"  # type: ignore[index]
            raw = await http.delete(f"/v1/conversations/{conv.id}/items/{before[4]}",
                                    headers=as_tenant("alpha"))  # fmt: skip
            assert raw.status_code == 200 and raw.json()["id"] == conv.id
    prompts = [[m["content"] for m in b["messages"]] for b in upstream.bodies()]
    assert prompts[1] == ["Be brief.", "Name a moon.", prompts[1][2], "Keep it short.",
                          "Which one?"]  # fmt: skip
    assert prompts[2][:3] == ["Be brief.", "Keep it short.", "Which one?"]
    assert prompts[2][-1] == "Why?" and len(prompts[2]) == 5


async def test_a_removed_call_leaves_its_turn_and_the_other_calls_keep_their_ids() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                asked = await sdk.responses.create(
                    model="default", input="Weather in Oslo? Use get_weather.", tools=[WEATHER]
                )
                [call] = asked.output
                assert call.type == "function_call"
                conv = "conv_" + asked.id[len("resp_") : len("resp_") + 24]
                # The call by the id its response gave it, as a client that has only that uses it.
                same = await sdk.conversations.items.retrieve(call.id, conversation_id=conv)
                assert same.type == "function_call" and same.call_id == call.call_id
                await sdk.conversations.items.delete(call.id, conversation_id=conv)
                assert [i.type async for i in sdk.conversations.items.list(conv)] == ["message"]
                emptied = await sdk.responses.retrieve(asked.id)
                assert [o.type for o in emptied.output] == ["message"]


def test_history_removes_one_call_its_text_or_a_message_in_place() -> None:
    def call(n: int) -> dict[str, Any]:
        return {"id": f"c{n}", "type": "function",
                "function": {"name": "f", "arguments": json.dumps({"n": n})}}  # fmt: skip

    history = History(pinned=[{"role": "system", "content": "S"}])
    reply = {"role": "assistant", "content": "Let me look.", "tool_calls": [call(0), call(1)]}
    history.append([{"role": "user", "content": "Q"}], reply)
    history.append([{"role": "tool", "tool_call_id": "c1", "content": "R"}],
                   {"role": "assistant", "content": "A"})  # fmt: skip
    untouched = history.prompt([])
    assert untouched[2] is reply  # nothing taken out yet: the stored messages as they are
    history.remove(reply, 0)
    assert history.prompt([])[2] == {**reply, "tool_calls": [call(1)]}
    assert reply["tool_calls"][1] == call(1)  # the other call stays where it was
    history.remove(reply)  # its text
    assert history.prompt([])[2] == {"role": "assistant", "content": None,
                                     "tool_calls": [call(1)]}  # fmt: skip
    history.remove(reply, 1)  # its last call: nothing of it is left
    restored = History.decode(history.encode())
    assert restored.removed == 3
    assert [m["content"] for m in restored.prompt([{"role": "user", "content": "N"}])] == [
        "S", "Q", "R", "A", "N"]  # fmt: skip
