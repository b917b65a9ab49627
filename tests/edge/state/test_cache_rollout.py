"""The response cache across a model rollout with no pinned version: once the fleet's backends
report new weights (SGLang's `weight_version`, from `/get_model_info`), the old weights'
answers are not replayed, streamed or whole, even to a request that only ever hit."""

from __future__ import annotations

from typing import Any

import pytest

from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.models.test_pools_e2e import sim, sims
from tests.edge.state.helpers import CHAT, state

USE = {"x-quicedge-cache": "use"}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_new_weights_on_the_fleet_invalidate_the_old_answers(stream: bool) -> None:
    async with sims(sim("m", model_version="v1")) as (backend,):
        config = fast_config([backend.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            body: dict[str, Any] = {
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "stream": stream,
            }  # fmt: skip

            async def ask() -> str:
                response = await http.post(CHAT, headers=USE, json=body)
                assert response.status_code == 200, response.text
                return str(response.headers["x-quicedge-cache"])

            assert [await ask(), await ask()] == ["miss", "hit-l1"]
            backend.config.model_version = "v2"  # the backend is given new weights
            catalog = edge.wiring.catalog
            catalog.expire()
            await catalog.refresh()  # the edge reads them from /get_model_info
            served = [b.model_version for b in edge.wiring.registry.backends]
            assert served == ["v2"]
            assert await ask() == "miss"  # answered by v2, not v1's answer replayed
            assert await ask() == "hit-l1"
