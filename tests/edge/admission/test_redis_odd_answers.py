"""A server at the Redis URL that answers, but not as a Redis does (a HELLO answered with a bare
+OK, on which redis-py raises AttributeError; a script answered with +OK), is Redis trouble like
any other: requests are decided by the local buckets, never a 500, and the breaker opens."""

from __future__ import annotations

import pytest

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, RedisSettings
from tests.edge.admission.test_app_admission import CHAT, bearer, tenant
from tests.edge.admission.test_redis_guard_probe import OddRedis
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.test_app_sim import metrics_text, sim_config

REDIS = {"timeout_ms": 1000.0, "slow_ms": 500.0, "backoff_s": 5.0, "backoff_max_s": 5.0}


@pytest.mark.parametrize("mode", ["odd", "redis"])
async def test_odd_answers_fall_back_to_local_buckets(mode: str) -> None:
    async with SimServer(sim_config("b1")) as sim, OddRedis() as server:
        server.mode = mode  # odd: HELLO gets +OK; redis: HELLO right, EVALSHA gets +OK
        config = fast_config([sim.url])
        config.admission = AdmissionSettings(
            redis=RedisSettings(url=server.url, fallback_share=0.5, **REDIS),  # type: ignore[arg-type]
            tenants=[tenant("acme", "silver", "sk-acme", requests_per_second=0.0001, burst=8)],
        )
        async with run_edge(config) as edge, client(edge) as http:
            codes = []
            for _ in range(6):
                r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-acme"))
                codes.append(r.status_code)
            # the local buckets at half the quota: 4 of the burst of 8
            assert codes == [200] * 4 + [429] * 2
            guard = edge.wiring.admission.guard
            assert guard is not None and guard.state == "open"
            text = await metrics_text(edge)
            assert 'quicedge_redis_breaker_trips_total{store="admission"} 1.0' in text
