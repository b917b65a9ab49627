"""Shadowing and the response cache: a stable request sampled for shadowing that is then answered
from the cache reaches no backend and mirrors nothing, so it does not use up a `shadow_rate`
token that a request the stable version answers could have mirrored."""

from __future__ import annotations

from typing import Any

from edge.models import ModelsConfig
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.models.test_pools_e2e import sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.edge.state.helpers import CHAT, state
from tests.helpers import wait_until

HEADERS = {"x-quicedge-cache": "use", "x-canary": "0"}


def _body(prompt: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "temperature": 0}  # fmt: skip


async def test_a_sampled_request_answered_from_the_cache_keeps_its_shadow_token() -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(
            shadow_fraction=1.0, shadow_rate=0.001, shadow_concurrency=4,
        )])  # fmt: skip
        config = fast_config([s1.url, s2.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config, models=models) as edge, client(edge) as http:
            shadow = edge.wiring.models.shadows["m"]
            first = await http.post(CHAT, headers=HEADERS, json=_body("hello"))
            assert first.headers["x-quicedge-cache"] == "miss"
            await wait_until(lambda: shadow.compared == 1)
            shadow._bucket.tokens = 1.0  # one mirror more may start (the rate refills slowly)
            hit = await http.post(CHAT, headers=HEADERS, json=_body("hello"))
            assert hit.status_code == 200 and hit.headers["x-quicedge-cache"] == "hit-l1"
            assert hit.json()["choices"][0].get("logprobs") is None  # none were asked for
            assert hit.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
            other = await http.post(CHAT, headers=HEADERS, json=_body("something else"))
            assert other.headers["x-quicedge-cache"] == "miss"
            await wait_until(lambda: shadow.compared == 2 or not shadow._tasks)
            await wait_until(lambda: not shadow._tasks)
            assert shadow.compared == 2  # the hit left the token to the request stable answered
            text = edge.registry.get_sample_value(
                "quicedge_shadow_requests_total", {"model": "m", "result": "dropped_rate"}
            )
            assert not text
