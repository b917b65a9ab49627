"""Every 429 for a tenant with a quota carries the rate-limit headers of each bucket it has, the
ones refused from memory (before the body is read) as well as the ones the store refused."""

from __future__ import annotations

import pytest

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, RedisSettings
from tests.edge.admission.test_app_admission import CHAT, bearer, tenant
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.test_app_sim import sim_config

REDIS = {"timeout_ms": 1000.0, "slow_ms": 500.0}


@pytest.mark.parametrize("store", ["memory", "redis", "redis-down"])
async def test_a_429_from_memory_carries_the_same_headers_as_the_stores(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """`redis-down`: nothing listens at the URL, so each process decides alone at half the
    quota (a burst of 1 of 2, 50000 tokens of 100000), which both 429s must say."""
    burst, tokens = (2, 50_000) if store == "redis-down" else (1, 100_000)
    redis = RedisSettings()
    if store != "memory":
        url = "redis://127.0.0.1:1/0" if store == "redis-down" else redis_url
        redis = RedisSettings(url=url, prefix=redis_prefix, fallback_share=0.5, **REDIS)  # type: ignore[arg-type]
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url])
        config.admission = AdmissionSettings(
            redis=redis,
            tenants=[
                tenant(
                    "both",
                    "silver",
                    "sk-both",
                    requests_per_second=0.05,
                    burst=burst,
                    tokens_per_minute=100_000,
                )  # fmt: skip
            ],
        )
        async with run_edge(config) as edge, client(edge) as http:
            answers = [
                await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-both"))
                for _ in range(3)
            ]
            assert [r.status_code for r in answers] == [200, 429, 429]
            first, by_store, by_memory = answers
            spent = tokens - int(first.headers["x-ratelimit-remaining-tokens"])
            assert 0 < spent < 1000  # the prompt, and the answer debited when it ended
            for r in (by_store, by_memory):
                assert r.headers["x-ratelimit-limit-requests"] == "1"
                assert r.headers["x-ratelimit-remaining-requests"] == "0"
                reset = r.headers["x-ratelimit-reset-requests"]
                assert reset.endswith("s") and 1 <= float(reset.rstrip("s")) <= 40, reset
                assert r.headers["x-ratelimit-limit-tokens"] == str(tokens)
                remaining = int(r.headers["x-ratelimit-remaining-tokens"])
                assert tokens - 2 * spent - 100 < remaining <= tokens
                assert "x-ratelimit-reset-tokens" in r.headers
