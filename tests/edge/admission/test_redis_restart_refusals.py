"""A Redis that answers PING but refuses every write: out of memory (`-OOM command not allowed`)
or a replica after a failover the edge's URL did not follow (`-READONLY`). The shared buckets
cannot be taken there, so the breaker must stay open (requests decided by the local buckets,
never a 500) for as long as the refusal lasts, rather than closing on each probe's PING only
for the next requests to fail and open it again, and close once Redis takes writes again."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import redis

from backends.sim import SimServer
from tests.edge.admission.test_redis_trouble import admission, edge_with, statuses
from tests.edge.silent_relay import SilentRelay
from tests.edge.test_app_sim import metrics_text, sim_config
from tests.helpers import RedisServer, free_port, wait_until

Refusal = tuple[Callable[[redis.Redis], object], Callable[[redis.Redis], object]]
REFUSALS: dict[str, Refusal] = {
    "oom": (
        lambda r: r.config_set("maxmemory", "1"),
        lambda r: r.config_set("maxmemory", "0"),
    ),
    # a replica of a master that is not there: it answers reads and PING, refuses writes
    "readonly": (
        lambda r: r.replicaof("127.0.0.1", str(free_port())),
        lambda r: r.replicaof("NO", "ONE"),
    ),
}


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
async def test_a_redis_refusing_writes_keeps_the_breaker_open_until_it_takes_them(
    own_redis: RedisServer, redis_prefix: str, refusal: str, caplog: pytest.LogCaptureFixture
) -> None:
    refuse, accept = REFUSALS[refusal]
    direct = redis.Redis(port=own_redis.port)
    caplog.set_level(logging.INFO, logger="edge.admission.redis_guard")
    async with SimServer(sim_config("b1")) as sim:
        settings = admission(own_redis.url, redis_prefix, burst=40, share=0.5)
        async with edge_with(settings, sim.url) as edge:
            guard = edge.wiring.admission.guard
            assert guard is not None
            assert await statuses(edge, 2) == [200, 200]  # shared: 38 of 40 left
            refuse(direct)
            try:
                # the local buckets at half the quota: 20 of the burst of 40
                assert await statuses(edge, 3) == [200] * 3
                assert guard.state != "closed"
                # several probes meet the refusal; requests between them stay local
                for probes in range(1, 4):
                    await wait_until(lambda: _failed_probes(caplog) >= probes, timeout=10)  # noqa: B023
                    assert await statuses(edge, 2) == [200, 200]
                assert guard.trips == 1
                assert not any("-> closed" in r.getMessage() for r in caplog.records)
                text = await metrics_text(edge)
                assert 'quicedge_redis_breaker_trips_total{store="admission"} 1.0' in text
            finally:
                accept(direct)
            await wait_until(lambda: guard.state == "closed", timeout=20)
            # the shared bucket again: 38 left there, less the takes Redis refused (none)
            codes = await statuses(edge, 40)
            assert codes == [200] * 38 + [429] * 2
            assert guard.trips == 1
    direct.close()


def _failed_probes(caplog: pytest.LogCaptureFixture) -> int:
    return sum("half_open -> open" in r.getMessage() for r in caplog.records)


async def test_a_failover_that_moves_the_address_is_followed(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """A failover behind one address (a Service, a VIP, DNS): the old master, now a replica,
    keeps the connections it had and answers them READONLY; new connections reach the new
    master. The breaker opens, and its probe must reach the new master (a connection of its
    own), not ask the old one for ever over a pooled connection."""
    promoted = RedisServer()
    direct = redis.Redis(port=own_redis.port)
    try:
        async with SilentRelay(own_redis.url) as relay, SimServer(sim_config("b1")) as sim:
            settings = admission(relay.url, redis_prefix, burst=40, share=0.5)
            async with edge_with(settings, sim.url) as edge:
                guard = edge.wiring.admission.guard
                assert guard is not None
                assert await statuses(edge, 2) == [200, 200]  # on the old master: 38 left
                direct.replicaof("127.0.0.1", str(promoted.port))
                relay.upstream = ("127.0.0.1", promoted.port)
                # READONLY from the old master: local buckets at half the quota
                assert await statuses(edge, 3) == [200] * 3
                await wait_until(lambda: guard.state == "closed", timeout=20)
                assert guard.trips == 1
                # the new master's buckets, full: 40 there
                codes = await statuses(edge, 42)
                assert codes == [200] * 40 + [429] * 2
                with redis.Redis(port=promoted.port) as r:
                    level = r.hget(redis_prefix + "acme:requests", "l")
                assert level is not None and float(level) == pytest.approx(0, abs=0.01)
    finally:
        direct.close()
        promoted.stop()
