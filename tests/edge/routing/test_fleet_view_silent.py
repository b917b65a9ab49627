"""The fleet view's load channel when its subscription's connection dies without a close (a
failover, a partition, a dropped NAT entry): the view finds out by PING, counts it, warns, and
hears the other processes again. Real Redis behind a relay that makes the connection silent."""

from __future__ import annotations

import logging

import pytest

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.redis_pubsub import Subscription, SubscriptionCollector
from edge.routing.fleet_view import FleetView, FleetViewConfig
from tests.edge.silent_relay import SilentRelay
from tests.helpers import free_port, wait_until


async def test_a_silently_dead_load_subscription_is_found_and_made_again(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    urls = [f"http://127.0.0.1:{free_port()}"]
    pools = [UpstreamPool(), UpstreamPool()]
    a, b = (BackendRegistry(urls, pool=pool) for pool in pools)
    # B repeats its (idle) figures every load_ttl / 4 = 0.1 s: A hears B all the time.
    # Every failure warned of: the severed connections' other failures (a publish timing out
    # on a loaded host) must not take the one warning a period allows before the PING's.
    config = FleetViewConfig(enabled=True, key=redis_prefix + "fv", interval=0.05, load_ttl=0.4,
                             timeout=0.5, warn_every=1e-6)  # fmt: skip
    async with SilentRelay(redis_url) as relay:
        view_a = FleetView(config, url=relay.url, backends=a.backends)
        view_b = FleetView(config, url=redis_url, backends=b.backends)
        view_a.subscription.ping_interval = view_a.subscription.ping_timeout = 0.25
        caplog.set_level(logging.WARNING, logger="edge.routing.fleet_view")
        try:
            await view_a.start()
            await view_b.start()
            await wait_until(lambda: view_a.loads_received > 0, timeout=5)
            assert relay.sever() > 0  # A's connections: the subscription's among them
            heard = view_a.loads_received
            failures = view_a.subscription.failures
            await wait_until(lambda: failures["silent"] >= 1, timeout=5)
            await wait_until(lambda: view_a.loads_received > heard + 2, timeout=5)
            assert view_a.listening and view_a.processes == 2
            assert any("PING" in r.getMessage() for r in caplog.records)
            samples = {
                tuple(s.labels.values()): s.value
                for family in SubscriptionCollector(lambda: [view_a.subscription]).collect()
                for s in family.samples
            }
            assert samples[("fleet_view", "silent")] >= 1
        finally:
            await view_a.aclose()
            await view_b.aclose()
            for pool in pools:
                await pool.aclose()


def test_a_subscription_refuses_bounds_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="subscription drains: ping_timeout must be > 0, got 0"):
        Subscription(None, "c", lambda _m: None, on_error=lambda _e: None, subscribe_timeout=1.0,
                     retry_after=1.0, ping_timeout=0, name="drains")  # fmt: skip
