"""The CPU one embeddings request can make the edge spend before a backend sees it is bounded:
`input` takes at most 2048 items (OpenAI's limit), so a body of two million one-character
inputs under `max_body_bytes` is refused with a 400 naming the field, not checked item by item
and joined into a routing text on the event loop (~200 ms of it, every other stream stalled)."""

from __future__ import annotations

import pytest

from backends.sim import SimConfig, SimServer
from tests.edge.conftest import client, fast_config, run_edge

MAX_EMBEDDING_INPUTS = 2048
"""OpenAI's limit on the items of one embeddings request (`edge.stages.validate`)."""


def stand_in() -> SimServer:
    return SimServer(SimConfig(name="a", port=0, profile="instant"))


@pytest.mark.parametrize("item", ["a", [1]])
async def test_more_embedding_inputs_than_openai_takes_are_refused_with_the_field_named(
    item: object,
) -> None:
    async with stand_in() as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            many = [item] * (MAX_EMBEDDING_INPUTS + 1)
            refused = await http.post("/v1/embeddings", json={"model": "default", "input": many})
            flood = await http.post(
                "/v1/embeddings", json={"model": "default", "input": ["a"] * 1_000_000}
            )
            most = [item] * MAX_EMBEDDING_INPUTS
            taken = await http.post("/v1/embeddings", json={"model": "default", "input": most})
            ids = list(range(MAX_EMBEDDING_INPUTS + 1000))  # one input of token ids
            one = await http.post("/v1/embeddings", json={"model": "default", "input": ids})
    for r in (refused, flood):
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "input" and error["code"] == "invalid_value"
        assert "2048" in error["message"]
    assert taken.status_code == 200 and one.status_code == 200
    assert a.api is not None and a.api.requests["/v1/embeddings"] == 2  # only those taken
