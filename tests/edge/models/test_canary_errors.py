"""What a canary's ramp counts as its errors, end to end: clients' bad requests, which reach both
versions, are no evidence against the canary, but a canary that refuses requests stable takes is
rolled back."""

from __future__ import annotations

from collections import Counter
from typing import Any

from edge.models import ModelsConfig
from edge.models.config import DriftConfig
from tests.edge.conftest import (
    client,
    fast_config,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.edge.models.test_rollout_e2e import rollout


def _body(i: int, *, bad_every: int, long: bool = False) -> dict[str, Any]:
    """Request `i`: every `bad_every`th asks for more tokens than any version's context (a
    client's mistake); with `long`, 3 in 10 others ask for 1,000, which only a bigger context
    takes."""
    body = chat("m")
    if i % bad_every == 0:
        body["max_tokens"] = 1_000_000
    elif long and i % 10 in (1, 2, 3):
        body["max_tokens"] = 1_000
    return body


async def test_clients_bad_requests_do_not_roll_back_an_identical_canary() -> None:
    """A fifth of the clients ask for more than the context length: both versions answer them
    400, as they should. The canary is no worse than stable and keeps its share."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(
            auto=True, step_requests=10_000, drift=DriftConfig(window=60),
        )])  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            statuses: Counter[int] = Counter()
            for i in range(240):
                r = await http.post("/v1/chat/completions", json=_body(i, bad_every=5),
                                    headers={"x-session-id": f"s{i}"})  # fmt: skip
                statuses[r.status_code] += 1
            assert statuses == {200: 192, 400: 48}
            assert ramp.rollout.state == "ramping", ramp.snapshot()
            canary_4xx, stable_4xx = ramp.client_error_rates()
            assert canary_4xx > 0.1 and stable_4xx is not None and stable_4xx > 0.1
            assert ramp.error_rate() <= 0.05


async def test_a_canary_that_refuses_requests_stable_takes_is_rolled_back() -> None:
    """The canary was given a smaller context: it answers 400 to a quarter of the requests,
    which stable serves, besides the fifth that both refuse. Those are the canary's errors."""
    async with sims(
        sim("m", model_version="v1", context_length=4096),
        sim("m", model_version="v2", context_length=512),
    ) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(
            auto=True, step_requests=10_000, drift=DriftConfig(window=60),
        )])  # fmt: skip
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=models) as edge,
            client(edge) as http,
        ):
            ramp = edge.wiring.models.ramps["m"]
            for i in range(400):
                if ramp.rollout.state == "rolled_back":
                    break
                body = _body(i, bad_every=5, long=True)
                await http.post("/v1/chat/completions", json=body,
                                headers={"x-session-id": f"s{i}"})  # fmt: skip
            assert ramp.rollout.state == "rolled_back", ramp.snapshot()
            assert "client errors" in ramp.rollout.reason
