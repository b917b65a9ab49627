"""`metadata` is held to OpenAI's rule (at most 16 string pairs, keys up to 64 characters, values
up to 512) everywhere the edge takes one: chat `store: true`, `POST /v1/responses`,
`POST /v1/conversations` and `POST /v1/conversations/{id}`; anything else is a 400 naming
`metadata`, and nothing is stored or forwarded."""

from __future__ import annotations

from typing import Any

import pytest

from edge.errors import InvalidRequest
from edge.state.responses import check_metadata
from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import CHAT, ChatUpstream, as_tenant, state, tenants

BAD: list[Any] = [
    {"k": 1},
    {f"k{i}": "v" for i in range(17)},
    {"k": "v" * 513},
    {"k" * 65: "v"},
    "oops",
    ["k", "v"],
]
LARGEST = {("k" * 62) + f"{i:02}": "v" * 512 for i in range(16)}


@pytest.mark.parametrize("value", [{}, {"a": "b"}, LARGEST])
def test_metadata_within_the_limits_is_kept_as_it_is(value: dict[str, str]) -> None:
    assert check_metadata(value) is value


@pytest.mark.parametrize("value", [*BAD, None])
def test_metadata_past_the_limits_is_a_400_naming_it(value: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_metadata(value)
    assert refused.value.param == "metadata"


async def test_every_route_that_takes_metadata_refuses_a_bad_one() -> None:
    upstream = ChatUpstream()
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            me = as_tenant("alpha")
            conv = (await http.post("/v1/conversations", headers=me, json={})).json()["id"]
            requests = [
                (CHAT, {"messages": [{"role": "user", "content": "hi"}], "store": True}),
                ("/v1/responses", {"model": "default", "input": "hi"}),
                ("/v1/conversations", {}),
                (f"/v1/conversations/{conv}", {}),
            ]
            for path, body in requests:
                for value in BAD:
                    refused = await http.post(path, headers=me, json={**body, "metadata": value})
                    assert refused.status_code == 400, (path, value)
                    error = refused.json()["error"]
                    assert error["param"] == "metadata", (path, value)
                    assert error["type"] == "invalid_request_error"
                kept = await http.post(path, headers=me, json={**body, "metadata": LARGEST})
                assert kept.status_code == 200, (path, kept.text)
                if path != CHAT:
                    assert kept.json()["metadata"] == LARGEST, path
            current = await http.get(f"/v1/conversations/{conv}", headers=me)
            assert current.json()["metadata"] == LARGEST  # the refused updates changed nothing
    assert len(upstream.chats) == 2  # only the two good inference requests reached it
