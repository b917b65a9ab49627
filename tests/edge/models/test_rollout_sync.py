"""Rollbacks and pauses shared by two edges through a real Redis (`[models] share_stops`), so are
advances (`share_advances`), and an edge goes on with its own ramp when that Redis goes away."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from edge.config import ProxyConfig
from edge.models import ModelsConfig
from edge.wiring import build
from tests.edge.conftest import Edge, client, fast_config, run_edge
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.edge.silent_relay import SilentRelay
from tests.helpers import RedisServer, wait_until


def ramp_state(edge: Edge) -> tuple[str, str]:
    r = edge.wiring.models.ramps["m"].rollout
    return r.state, r.reason


async def subscribed(*edges: Edge) -> None:
    for edge in edges:
        sync = edge.wiring.rollout_sync
        assert sync is not None
        await wait_until(sync.subscribed.is_set)


async def test_a_pause_and_a_rollback_on_one_edge_are_taken_by_the_other(
    redis_url: str, redis_prefix: str
) -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=redis_url) as a,
            run_edge(config, models=models, redis_url=redis_url) as b,
            httpx.AsyncClient() as admin,
        ):
            await subscribed(a, b)
            assert (await admin.post(a.admin_url + "/rollouts/m/pause")).status_code == 200
            await wait_until(lambda: ramp_state(b)[0] == "paused")
            assert ramp_state(b)[1].startswith("edge ") and ramp_state(b)[1].endswith("operator")
            # And back the other way, once: the edge that took it does not hear its own.
            assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back")
            assert [t.action for t in a.wiring.models.ramps["m"].history] == ["pause", "rollback"]
            assert [t.action for t in b.wiring.models.ramps["m"].history] == ["pause", "rollback"]
            assert a.wiring.rollout_sync.received == 1  # type: ignore[union-attr]
            assert b.wiring.rollout_sync.received == 1  # type: ignore[union-attr]


async def test_an_advance_on_one_edge_is_followed_by_the_other_at_that_step(
    redis_url: str, redis_prefix: str
) -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        ramp = rollout(steps=[5.0, 50.0, 100.0], auto=True, step_requests=3, step_seconds=0)
        models = ModelsConfig(rollouts=[ramp], share_advances=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=redis_url) as a,
            run_edge(config, models=models, redis_url=redis_url) as b,
            client(a) as http,
        ):
            await subscribed(a, b)
            for _ in range(3):  # canary requests to `a` only: its step is done, `b` saw none
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "1"})  # fmt: skip
                assert r.status_code == 200
            follower = b.wiring.models.ramps["m"]
            await wait_until(lambda: follower.rollout.percent == 50.0)
            assert follower.step == 1 and follower.step_requests == 0
            assert ramp_state(b) == ("ramping", ramp_state(b)[1])
            assert ramp_state(b)[1].startswith("edge ") and "step done" in ramp_state(b)[1]
            # An operator's promotion on `b` takes `a` to the end too; nothing comes back twice.
            async with httpx.AsyncClient() as admin:
                assert (await admin.post(b.admin_url + "/rollouts/m/promote")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "promoted")
            assert [t.action for t in follower.history] == ["advance", "advance", "promoted"]
            # `a` hears b's advance to 100 % and the promotion, in either order (two publishes).
            actions = [t.action for t in a.wiring.models.ramps["m"].history]
            assert actions[0] == "advance" and actions[-1] == "promoted", actions
            assert actions.count("promoted") == 1
            assert b.wiring.rollout_sync.received == 1  # type: ignore[union-attr]


async def test_without_redis_each_edge_keeps_its_own_ramp(redis_prefix: str) -> None:
    redis = RedisServer()
    try:
        async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
            config = fast_config([s1.url, s2.url])
            models = ModelsConfig(
                rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r"
            )
            async with run_edge(config, models=models, redis_url=redis.url) as edge:
                await subscribed(edge)
                redis.stop()
                sync = edge.wiring.rollout_sync
                assert sync is not None
                async with httpx.AsyncClient() as admin:
                    answer = await admin.post(edge.admin_url + "/rollouts/m/rollback")
                assert answer.status_code == 200 and ramp_state(edge)[0] == "rolled_back"
                await wait_until(lambda: sync.errors > 0)  # the publish failed, boundedly
    finally:
        redis.stop()


async def test_sharing_stops_without_a_redis_is_refused() -> None:
    from prometheus_client import CollectorRegistry

    models = ModelsConfig(rollouts=[rollout()], share_stops=True)
    with pytest.raises(ValueError, match="share_stops: sharing rollouts needs a Redis"):
        await build(fast_config(["http://127.0.0.1:9"]), registry=CollectorRegistry(),
                    models=models)  # fmt: skip


async def test_a_rollback_while_an_edges_subscription_is_silently_dead_still_reaches_it(
    redis_url: str, redis_prefix: str
) -> None:
    """A's connections to Redis die without a close (a failover, a partition); B rolls back
    at that moment. A's PING finds the dead subscription, A subscribes again and takes the
    rollback it missed from the log."""
    async with (
        sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2),
        SilentRelay(redis_url) as relay,
    ):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=relay.url, start=False) as a,
            run_edge(config, models=models, redis_url=redis_url) as b,
            httpx.AsyncClient() as admin,
        ):
            sync = a.wiring.rollout_sync
            assert sync is not None
            sync.ping_interval = sync.ping_timeout = 0.25
            await a.wiring.start()
            await subscribed(a, b)
            assert relay.sever() > 0
            assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=10)
            assert ramp_state(a)[1].startswith("edge ") and ramp_state(a)[1].endswith("operator")
            assert sync.subscription is not None and sync.subscription.failures["silent"] >= 1
            assert sync.caught_up == 1


async def test_a_stop_read_back_from_the_log_does_not_undo_a_later_resume_here(
    redis_url: str, redis_prefix: str
) -> None:
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=redis_url) as a,
            httpx.AsyncClient() as admin,
        ):
            sync = a.wiring.rollout_sync
            assert sync is not None
            assert (await admin.post(a.admin_url + "/rollouts/m/pause")).status_code == 200
            assert (await admin.post(a.admin_url + "/rollouts/m/promote")).status_code == 200
            assert ramp_state(a)[0] == "ramping"  # an operator's resume, here only
            stop = orjson.dumps({"i": "elsewhere", "model": "m", "action": "rollback", "step": 0,
                                 "reason": "canary errors"})  # fmt: skip
            sync.take(stop, published_at=time.monotonic() - 5)  # from before the resume
            assert ramp_state(a)[0] == "ramping"
            sync.take(stop, published_at=time.monotonic())
            assert ramp_state(a) == ("rolled_back", "edge elsewhere: canary errors")


async def test_an_edge_does_not_take_what_another_canary_version_went_through(
    redis_url: str, redis_prefix: str
) -> None:
    """A reload reaches the edges one by one: `a` still ramps canary v2 while `b` and `c` were
    given v3. What v2's ramp goes through (an advance, a pause) says nothing of v3, which `b`
    has no evidence for yet; a pause on `c`, of v3, is taken."""
    async with sims(
        sim("m", model_version="v1"), sim("m", model_version="v2"), sim("m", model_version="v3")
    ) as (s1, s2, s3):
        config = fast_config([s1.url, s2.url, s3.url])
        key = redis_prefix + "r"
        steps = {"steps": [5.0, 50.0, 100.0]}
        old = ModelsConfig(rollouts=[rollout(**steps)], share_stops=True, share_advances=True,
                           share_key=key)  # fmt: skip
        new = ModelsConfig(rollouts=[rollout(canary="v3", **steps)], share_stops=True,
                           share_advances=True, share_key=key)  # fmt: skip
        await only_the_pause_of_its_own_entry_is_taken(
            config, old, new, redis_url, ["promote", "pause"]
        )


async def only_the_pause_of_its_own_entry_is_taken(
    config: ProxyConfig, old: ModelsConfig, new: ModelsConfig, redis_url: str, actions: list[str]
) -> None:
    """Edge `a` runs `old` and takes `actions` (published); `b` and `c` run `new`. `b` takes
    none of `a`'s transitions, and takes `c`'s pause, published after them: once `b` has it,
    it had theirs."""
    async with (
        run_edge(config, models=old, redis_url=redis_url) as a,
        run_edge(config, models=new, redis_url=redis_url) as b,
        run_edge(config, models=new, redis_url=redis_url) as c,
        httpx.AsyncClient() as admin,
    ):
        await subscribed(a, b, c)
        for action in actions:
            assert (await admin.post(f"{a.admin_url}/rollouts/m/{action}")).status_code == 200
        sync = a.wiring.rollout_sync
        assert sync is not None
        await wait_until(lambda: sync.published == len(actions))
        assert (await admin.post(c.admin_url + "/rollouts/m/pause")).status_code == 200
        await wait_until(lambda: ramp_state(b)[0] == "paused")
        follower = b.wiring.models.ramps["m"]
        assert [t.action for t in follower.history] == ["pause"], follower.snapshot()
        assert follower.rollout.percent == 5.0 and follower.step == 0


async def test_a_redis_slower_than_the_timeout_does_not_make_the_subscription_flap(
    redis_url: str, redis_prefix: str
) -> None:
    """A's subscription dies silently while B rolls back, and A's Redis answers the catch-up
    read later than the sync's `timeout`. A stays subscribed (no new subscription each time the
    read times out) and retries the read, with a longer wait, until the rollback is taken."""
    async with (
        sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2),
        SilentRelay(redis_url) as relay,
    ):
        config = fast_config([s1.url, s2.url])
        models = ModelsConfig(rollouts=[rollout()], share_stops=True, share_key=redis_prefix + "r")
        async with (
            run_edge(config, models=models, redis_url=relay.url, start=False) as a,
            run_edge(config, models=models, redis_url=redis_url) as b,
            httpx.AsyncClient() as admin,
        ):
            sync = a.wiring.rollout_sync
            assert sync is not None and sync.timeout == 0.5
            sync.ping_interval = sync.ping_timeout = 0.25
            await a.wiring.start()
            await subscribed(a, b)
            relay.slow_after, relay.reply_delay = (b"XRANGE",), 0.8  # the catch-up's read
            assert relay.sever() > 0
            assert (await admin.post(b.admin_url + "/rollouts/m/rollback")).status_code == 200
            await wait_until(lambda: ramp_state(a)[0] == "rolled_back", timeout=10)
            assert sync.caught_up == 1 and sync.catch_up_failures >= 1
            assert sync.subscription is not None
            assert sync.subscription.failures == {"silent": 1, "error": 0}
            assert sync.subscribed.is_set()
            exported = a.registry.get_sample_value("quicedge_rollout_sync_catch_up_failures_total")
            assert exported == sync.catch_up_failures


async def test_an_edge_does_not_take_an_advance_through_steps_it_was_not_given(
    redis_url: str, redis_prefix: str
) -> None:
    """A reload that keeps both versions and changes the steps reaches the edges one by one:
    `a` still ramps through [5, 50, 100] while `b` and `c` were given [5, 10, 20, 50, 100].
    `a`'s advance to its step 1 (50 %) is no step of `b`'s rollout: `b` must not go to its own
    step 1 (10 %) on it. A pause on `c`, of the same entry as `b`'s, is taken."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        config = fast_config([s1.url, s2.url])
        shared = {"share_stops": True, "share_advances": True, "share_key": redis_prefix + "r"}
        old = ModelsConfig(rollouts=[rollout(steps=[5.0, 50.0, 100.0])], **shared)
        new = ModelsConfig(rollouts=[rollout(steps=[5.0, 10.0, 20.0, 50.0, 100.0])], **shared)
        await only_the_pause_of_its_own_entry_is_taken(config, old, new, redis_url, ["promote"])


async def test_a_transition_without_the_entry_is_judged_by_its_versions(
    redis_url: str, redis_prefix: str
) -> None:
    """An edge of an older release names the versions only (or nothing): it is taken when they
    are this rollout's (as docs/models.md says), not when they are another's."""
    async with sims(sim("m", model_version="v1"), sim("m", model_version="v2")) as (s1, s2):
        models = ModelsConfig(rollouts=[rollout(steps=[5.0, 50.0, 100.0])], share_stops=True,
                              share_advances=True, share_key=redis_prefix + "r")  # fmt: skip
        async with run_edge(fast_config([s1.url, s2.url]), models=models,
                            redis_url=redis_url) as edge:  # fmt: skip
            sync = edge.wiring.rollout_sync
            assert sync is not None
            ramp = edge.wiring.models.ramps["m"]
            other = {"i": "elsewhere", "model": "m", "stable": "v1", "canary": "v3",
                     "action": "advance", "step": 1, "reason": "r"}  # fmt: skip
            sync.take(orjson.dumps(other))
            assert ramp.step == 0
            sync.take(orjson.dumps({**other, "canary": "v2"}))
            assert ramp.step == 1
            sync.take(orjson.dumps({**other, "canary": None, "stable": None, "step": 2}))
            assert ramp.step == 2
