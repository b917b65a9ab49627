"""A conversation's turn is committed before its client has the answer's end: a client that
sends the next turn the moment it has the answer (an agent's loop) never finds the
conversation still held (409 `conversation_busy`), however long the commit takes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, state


def response_id(text: str, stream: bool) -> str:
    if not stream:
        return str(json.loads(text)["id"])
    for line in text.splitlines():
        if line.startswith("data: ") and '"response.completed"' in line:
            return str(json.loads(line[6:])["response"]["id"])
    raise AssertionError(f"no response.completed in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_turn_sent_at_once_finds_the_last_one_committed(stream: bool) -> None:
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=state())) as edge, client(edge) as http:
            conversations = edge.wiring.app.state.conversations
            commit = conversations.commit

            async def slow_commit(*args: Any, **kwargs: Any) -> bool:
                await asyncio.sleep(0.2)  # a Redis answering late: the race made wide
                return bool(await commit(*args, **kwargs))

            conversations.commit = slow_commit
            previous: str | None = None
            for turn in range(2):
                body: dict[str, Any] = {"model": "default", "input": f"turn {turn}",
                                        "stream": stream}  # fmt: skip
                if previous is not None:
                    body["previous_response_id"] = previous
                answer = await http.post("/v1/responses", json=body)
                assert answer.status_code == 200, answer.text
                previous = response_id(answer.text, stream)
