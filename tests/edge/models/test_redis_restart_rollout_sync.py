"""Shared rollout stops across a Redis restart (killed, started again empty on its port): a
rollback taken on one edge while Redis is away reaches the others once it is back, not never;
one that a resume here has undone meanwhile is not sent late."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from edge.models import ModelsConfig
from edge.models.rollout_sync import RolloutSync
from tests.edge.conftest import Edge, fast_config, run_edge
from tests.edge.models.test_pools_e2e import sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.edge.models.test_rollout_sync import ramp_state, subscribed
from tests.edge.silent_relay import SilentRelay
from tests.helpers import RedisServer, wait_until


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@contextlib.asynccontextmanager
async def two_edges(
    own_redis: RedisServer, redis_prefix: str
) -> AsyncIterator[tuple[Edge, Edge, RolloutSync, RolloutSync, httpx.AsyncClient]]:
    """Two edges sharing their stops through `own_redis`, each subscribed, in front of a
    stable (v1) and a canary (v2) stand-in: (a, b, a's sync, b's sync, an admin client)."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=own_redis.url) as a,
            run_edge(config, models=models, redis_url=own_redis.url) as b,
            httpx.AsyncClient() as admin,
        ):
            await subscribed(a, b)
            sync_a, sync_b = a.wiring.rollout_sync, b.wiring.rollout_sync
            assert sync_a is not None and sync_b is not None
            yield a, b, sync_a, sync_b, admin


async def test_a_rollback_while_redis_is_down_reaches_the_other_edge_once_it_is_back(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    async with two_edges(own_redis, redis_prefix) as (a, b, sync_a, sync_b, admin):
        own_redis.stop()
        assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
        await wait_until(lambda: sync_b.errors >= 1, timeout=10)  # the publish failed
        assert ramp_state(a)[0] != "rolled_back"
        restarted = RedisServer(port=own_redis.port)
        try:
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=15)
            assert ramp_state(a)[1].startswith("edge ")
            assert ramp_state(a)[1].endswith("operator")
            assert sync_b.published == 1 and sync_a.received == 1
        finally:
            restarted.stop()


async def test_a_stop_undone_here_while_redis_was_down_is_not_sent_late(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    async with two_edges(own_redis, redis_prefix) as (a, b, sync_a, sync_b, admin):
        own_redis.stop()
        assert (await admin.post(b.admin_url + "/rollouts/m/pause")).status_code == 200
        await wait_until(lambda: sync_b.errors >= 1, timeout=10)
        # the operator resumes it here before Redis is back: the pause is over
        assert (await admin.post(b.admin_url + "/rollouts/m/promote")).status_code == 200
        assert ramp_state(b)[0] != "paused"
        restarted = RedisServer(port=own_redis.port)
        try:
            await subscribed(a)
            # a rollback after it goes out, and only it: A never pauses
            assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=15)
            assert [t.action for t in a.wiring.models.ramps["m"].history] == ["rollback"]
            assert sync_a.received == 1
        finally:
            restarted.stop()


async def test_a_stop_sent_late_is_not_taken_by_an_edge_that_resumed_after_it(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """B pauses while Redis is away; A pauses and resumes by hand after that. B's pause, sent
    once Redis is back, is older than A's resume and does not pause A again (as a pause read
    back from the log would not)."""
    async with two_edges(own_redis, redis_prefix) as (a, b, sync_a, sync_b, admin):
        own_redis.stop()
        assert (await admin.post(b.admin_url + "/rollouts/m/pause")).status_code == 200
        await wait_until(lambda: sync_b.errors >= 1, timeout=10)
        # A's resume a second after B's pause: A dates B's pause by its arrival less its
        # `ago`, so the delivery's own time counts as later; a resume within that time of
        # the pause is not told apart from one before it, and the pause is taken (the safe
        # side). A loaded host delivers in tens, even hundreds, of milliseconds.
        await asyncio.sleep(1.0)
        assert (await admin.post(a.admin_url + "/rollouts/m/pause")).status_code == 200
        assert (await admin.post(a.admin_url + "/rollouts/m/promote")).status_code == 200
        restarted = RedisServer(port=own_redis.port)
        try:
            await wait_until(lambda: sync_b.published == 1, timeout=15)
            await subscribed(a)
            # a rollback after it, which A takes: the pause came before it, or not at all
            assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=15)
            actions = [t.action for t in a.wiring.models.ramps["m"].history]
            assert actions == ["pause", "resume", "rollback"]
        finally:
            restarted.stop()


async def test_a_rollback_after_a_failover_that_moves_the_address_reaches_the_other_edge(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """A failover behind one address (a Service, a VIP, DNS): the old master, now a replica,
    keeps the connections it had and refuses their writes (READONLY); new connections reach the
    new master. A rollback's publish must get there, not be refused for ever (kept and sent
    again on the same connection)."""
    promoted = RedisServer()
    async with (
        sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2),
        SilentRelay(own_redis.url) as relay,
    ):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        try:
            async with (
                run_edge(config, models=models, redis_url=relay.url) as a,
                run_edge(config, models=models, redis_url=relay.url) as b,
                httpx.AsyncClient() as admin,
            ):
                await subscribed(a, b)
                sync_b = b.wiring.rollout_sync
                assert sync_b is not None
                assert (await admin.post(b.admin_url + "/rollouts/m/pause")).status_code == 200
                await wait_until(lambda: ramp_state(a)[0] == "paused", timeout=10)
                with redis.Redis(port=own_redis.port) as r:
                    r.replicaof("127.0.0.1", str(promoted.port))
                    relay.upstream = ("127.0.0.1", promoted.port)
                    # A's subscription stays on the old master: a replica hears what its master
                    # publishes once its link is up (news in between is lost there)
                    await wait_until(
                        lambda: r.info("replication")["master_link_status"] == "up", timeout=15
                    )
                assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
                await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=15)
                assert sync_b.published == 2
                with redis.Redis(port=promoted.port) as r:
                    assert r.xlen(redis_prefix + "r:log") == 1  # the rollback, on the new master
        finally:
            promoted.stop()
