"""What a conversation keeps besides its messages (each turn's response fields: the echoed
`instructions`, `tools`, `text`...) is bounded by `state.conversations.max_bytes` too, and a
field sent alike every turn is kept once; real Redis, a scripted upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio

from edge.state.conversations import History
from edge.state.redis_store import Unreadable
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, state

LIMIT = 64 * 1024


async def respond(http: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    """POST /v1/responses; a 409 is retried for a while (the turn before is committed just
    after its client has the answer)."""
    async with asyncio.timeout(5):
        while True:
            answer = await http.post("/v1/responses", json=body)
            if answer.status_code != 409:
                return answer
            await asyncio.sleep(0.05)


async def stored_bytes(redis_url: str, prefix: str) -> list[int]:
    direct = redis.asyncio.from_url(redis_url)
    try:
        return [await direct.strlen(k) async for k in direct.scan_iter(f"{prefix}conv:*")]
    finally:
        await direct.aclose()


async def turns(http: httpx.AsyncClient, instructions: list[str]) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    for n, text in enumerate(instructions):
        body: dict[str, Any] = {"model": "default", "input": f"turn {n}", "instructions": text}
        if answers:
            body["previous_response_id"] = answers[-1].json()["id"]
        answer = await respond(http, body)
        assert answer.status_code == 200, answer.text[:300]
        answers.append(answer)
    return answers


async def test_turns_echoing_new_instructions_each_cannot_grow_it_past_the_limit(
    redis_url: str, redis_prefix: str
) -> None:
    settings = state(redis_url, redis_prefix, conversations={"max_bytes": LIMIT})
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            distinct = [f"{n} " + "x" * 20_000 for n in range(12)]
            answers = await turns(http, distinct)
            (size,) = await stored_bytes(redis_url, redis_prefix)
            assert size <= 2 * LIMIT  # its messages and what its turns keep: each at most LIMIT
            assert answers[-1].json()["truncation"] == "auto"
            first = await http.get(f"/v1/responses/{answers[0].json()['id']}")
            assert first.status_code == 404  # dropped to fit, as an old turn past the limit is
            last = await http.get(f"/v1/responses/{answers[-1].json()['id']}")
            assert last.status_code == 200 and last.json()["instructions"] == distinct[-1]
    refusing = state(redis_url, redis_prefix + "r:",
                     conversations={"max_bytes": LIMIT, "overflow": "reject"})  # fmt: skip
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=refusing)) as edge, client(edge) as http:
            kept = await turns(http, distinct[:4])  # the fourth's are past the limit once kept
            latest = kept[-1].json()["id"]
            refused = await respond(http, {"model": "default", "input": "more",
                                           "instructions": distinct[4],
                                           "previous_response_id": latest})  # fmt: skip
            assert refused.status_code == 413, refused.text[:300]
            error = refused.json()["error"]
            assert error["code"] == "conversation_too_large"
            assert "kept responses" in error["message"]
            again = await http.get(f"/v1/responses/{kept[0].json()['id']}")
            assert again.status_code == 200  # unchanged


async def test_instructions_sent_alike_every_turn_are_kept_once(
    redis_url: str, redis_prefix: str
) -> None:
    settings = state(redis_url, redis_prefix, conversations={"max_bytes": LIMIT})
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            same = "Be brief. " + "y" * 20_000
            answers = await turns(http, [same] * 12)
            (size,) = await stored_bytes(redis_url, redis_prefix)
            assert size < LIMIT // 2
            for answer in (answers[0], answers[5], answers[-1]):  # nothing was dropped
                back = await http.get(f"/v1/responses/{answer.json()['id']}")
                assert back.status_code == 200 and back.json()["instructions"] == same
                assert back.json()["previous_response_id"] == answer.json()["previous_response_id"]


def test_echoes_are_kept_apart_and_read_back_whole() -> None:
    history = History()
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    for n in range(3):
        echo = {"instructions": "same", "tools": tools, "previous_response_id": f"r{n}",
                "temperature": 1 if n else True}  # fmt: skip
        history.append([{"role": "user", "content": f"q{n}"}], {"role": "assistant",
                       "content": f"a{n}"}, {"id": f"m{n}", "echo": echo})  # fmt: skip
    history.append([{"role": "user", "content": "chat"}], {"role": "assistant", "content": "c"})
    blob = history.encode()
    assert blob.count(b'"same"') == 1 and blob.count(b'"parameters"') == 1
    back = History.decode(blob)
    assert back.meta == history.meta  # `true` then `1` are not alike: each kept as it was
    assert back.meta[1]["echo"]["temperature"] == 1 and back.meta[0]["echo"]["temperature"] is True
    assert back.stored == len(blob)
    back.drop_oldest()  # the first kept turn's echo is then kept whole
    assert History.decode(back.encode()).meta == back.meta
    older = orjson.loads(blob)
    older["u"] = history.meta  # a value stored before echoes were kept apart
    del older["e"]
    assert History.decode(orjson.dumps(older)).meta == history.meta


@pytest.mark.parametrize(
    "echoes",
    [
        [None],
        [["x"], None, None, None],
        [[["a", 1]], ["b"], None, None],
        [[[1, 2]], None, None, None],
        "e",
    ],  # fmt: skip
)
def test_an_echo_it_cannot_read_is_unreadable(echoes: Any) -> None:
    history = History()
    for n in range(4):
        history.append([{"role": "user", "content": f"q{n}"}], {"role": "assistant",
                       "content": f"a{n}"}, {"id": f"m{n}"})  # fmt: skip
    stored = orjson.loads(history.encode())
    stored["e"] = echoes
    with pytest.raises(Unreadable):
        History.decode(orjson.dumps(stored))
