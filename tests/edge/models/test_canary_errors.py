"""What a canary's ramp counts as its errors, end to end: clients' bad requests, which reach both
versions, are no evidence against the canary, but a canary that refuses requests stable takes is
rolled back; and one request is one canary error at most."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from edge.models import ModelsConfig
from edge.models.config import BackendModel, DriftConfig
from edge.routing.breakers import BreakerConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until


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


def _refusing(release: asyncio.Event) -> Any:
    """A canary backend: 500 to every request, but a 503 (worth another backend) to the one
    whose prompt says so, once `release` is set."""

    async def script(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        status = 500
        if b"hold me" in recorded.body:
            await release.wait()
            status = 503
        error = {"error": {"message": "boom", "type": "server_error", "code": status}}
        return Reply(status=status, chunks=[json.dumps(error).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    return script


async def test_a_request_is_one_canary_error_when_the_breaker_opens_before_its_retry() -> None:
    """A canary request's attempt fails with a 503 and is retried; meanwhile other canary
    requests' failures opened the canary's breaker, which sends the retry to stable. The
    request made one canary attempt: one canary error, not a second for the refusal."""
    release = asyncio.Event()
    async with (
        sims(sim("m", model_version="v1")) as (s1,),
        TinyUpstream(_refusing(release)) as c1,
        TinyUpstream(_refusing(release)) as c2,
    ):
        models = ModelsConfig(
            backends=[
                BackendModel(c1.url, model="m", version="v2"),
                BackendModel(c2.url, model="m", version="v2"),
            ],  # fmt: skip
            rollouts=[rollout(steps=[50.0])],
        )
        breakers = BreakerConfig(window=10, min_requests=5, open_for=60.0)
        config = fast_config([s1.url, c1.url, c2.url], eject_after_failures=1000)
        async with run_edge(config, models=models, breakers=breakers) as edge, \
                client(edge) as http:  # fmt: skip
            assert edge.wiring.breakers is not None
            ramp = edge.wiring.models.ramps["m"]
            canary = {"x-canary": "1"}
            held = {**chat("m"), "messages": [{"role": "user", "content": "hold me"}]}
            first = asyncio.ensure_future(
                http.post("/v1/chat/completions", json=held, headers=canary)
            )
            await wait_until(  # it reached a canary backend
                lambda: any(b"hold me" in r.body for r in [*c1.requests, *c2.requests])
            )
            for _ in range(5):
                r = await http.post("/v1/chat/completions", json=chat("m"), headers=canary)
                assert r.status_code == 500
            assert edge.wiring.breakers.state_of("m@v2", "bronze", "default") == "open"
            release.set()
            answer = await asyncio.wait_for(first, 10)
            assert answer.status_code == 200  # stable served its retry
            assert len(ramp._errors) == 6 and ramp._error_count == 6, ramp.snapshot()
