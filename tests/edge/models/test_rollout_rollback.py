"""A rollback under load: a request already on the canary finishes there, but what a canary
request sends after the rollback (its retry) goes to stable, as every new request does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from edge.models import ModelsConfig
from edge.models.config import BackendModel
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, netloc, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until


def _asked(*backends: TinyUpstream) -> int:
    return sum(r.path == "/v1/chat/completions" for b in backends for r in b.requests)


def _failing(release: asyncio.Event) -> Any:
    """A canary backend that holds each request until `release`, then answers 503 (a failure
    worth another backend)."""

    async def script(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        await release.wait()
        error = {"error": {"message": "boom", "type": "server_error", "code": 503}}
        return Reply(status=503, chunks=[json.dumps(error).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    return script


async def test_a_canary_requests_retry_after_a_rollback_goes_to_stable() -> None:
    """A canary request is on a canary backend when the operator rolls the rollout back; that
    backend then fails it. Its retry goes to stable, not to the other canary backend."""
    release = asyncio.Event()
    async with (
        sims(sim("m", model_version="v1")) as (s1,),
        TinyUpstream(_failing(release)) as c1,
        TinyUpstream(_failing(release)) as c2,
    ):
        models = ModelsConfig(
            backends=[
                BackendModel(c1.url, model="m", version="v2"),
                BackendModel(c2.url, model="m", version="v2"),
            ],  # fmt: skip
            rollouts=[rollout(steps=[50.0])],
        )
        config = fast_config([s1.url, c1.url, c2.url], eject_after_failures=1000)
        async with run_edge(config, models=models) as edge, client(edge) as http:
            ramp = edge.wiring.models.ramps["m"]
            pending = asyncio.ensure_future(
                http.post("/v1/chat/completions", json=chat("m"), headers={"x-canary": "1"})
            )
            await wait_until(lambda: _asked(c1, c2) == 1)
            ramp.rollback("operator")
            release.set()
            answer = await asyncio.wait_for(pending, 10)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-quicedge-backend"] == netloc(s1)
            assert _asked(c1, c2) == 1  # no second canary attempt
