"""`[proxy] share_drains`: a drain on one edge holds the backend on every edge of the Redis, and
on one that starts later; Redis away refuses the drain and changes nothing; Redis restarted
empty undrains nothing; a late answer is read back; a dead subscription is found. Edges
in-process, real Redis, real sockets."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from backends.sim import SimServer
from tests.edge.conftest import Edge, fast_config, run_edge
from tests.edge.silent_relay import SilentRelay
from tests.edge.test_app_sim import sim_config
from tests.helpers import RedisServer, free_port, wait_until


async def held(edge: Edge) -> dict[str, bool]:
    async with httpx.AsyncClient(timeout=10) as http:
        backends = (await http.get(edge.admin_url + "/backends")).json()["backends"]
    return {b["name"]: b["held"] for b in backends}


async def post(edge: Edge, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(edge.admin_url + path)


async def test_a_drain_on_one_edge_holds_the_backend_on_every_edge(redis_url: str) -> None:
    async with SimServer(sim_config("s1")) as s1, SimServer(sim_config("s2")) as s2:
        config = fast_config(
            [s1.url, s2.url], share_drains=True, drains_interval=0.1,
            drains_key=f"test:drains:{uuid.uuid4().hex}",
        )  # fmt: skip
        name = s1.url.partition("//")[2]
        async with (
            run_edge(config, redis_url=redis_url) as a,
            run_edge(config, redis_url=redis_url) as b,
        ):
            drained = await post(a, f"/backends/{name}/drain")
            assert drained.status_code == 200 and drained.json()["held"] is True
            deadline = asyncio.get_running_loop().time() + 10
            while not (await held(b))[name]:  # the other edge's next read of the hash
                assert asyncio.get_running_loop().time() < deadline, "never held on edge b"
                await asyncio.sleep(0.05)
            async with run_edge(config, redis_url=redis_url) as late:
                assert (await held(late))[name]  # before its first request
                async with httpx.AsyncClient(base_url=late.url, timeout=10) as http:
                    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                    for _ in range(4):
                        answer = await http.post("/v1/chat/completions", json=chat)
                        assert answer.headers["x-quicedge-backend"] != name
            undrained = await post(b, f"/backends/{name}/undrain")
            assert undrained.status_code == 200
            await wait_until(lambda: not a.wiring.registry.get(name).held)  # type: ignore[union-attr]
            assert await held(a) == {name: False, s2.url.partition("//")[2]: False}


async def test_another_edge_holds_the_drain_when_it_is_announced_not_a_poll_later(
    redis_url: str,
) -> None:
    async with SimServer(sim_config("s1")) as s1, SimServer(sim_config("s2")) as s2:
        config = fast_config(
            [s1.url, s2.url], share_drains=True, drains_interval=3600.0,
            drains_key=f"test:drains:{uuid.uuid4().hex}",
        )  # fmt: skip
        name = s1.url.partition("//")[2]
        async with (
            run_edge(config, redis_url=redis_url) as a,
            run_edge(config, redis_url=redis_url) as b,
        ):
            holds = b.wiring.holds
            assert holds is not None
            await asyncio.wait_for(holds.subscribed.wait(), 10)
            assert (await post(a, f"/backends/{name}/drain")).status_code == 200
            # An hour between reads: only the announcement can bring it here.
            await wait_until(lambda: b.wiring.registry.get(name).held, timeout=5)  # type: ignore[union-attr]
            assert (await post(a, f"/backends/{name}/undrain")).status_code == 200
            await wait_until(lambda: not b.wiring.registry.get(name).held, timeout=5)  # type: ignore[union-attr]


async def test_redis_away_refuses_the_drain_and_changes_nothing() -> None:
    async with SimServer(sim_config("s1")) as s1:
        config = fast_config([s1.url], share_drains=True, drains_interval=0.1)
        away = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        async with run_edge(config, redis_url=away) as edge:
            name = s1.url.partition("//")[2]
            refused = await post(edge, f"/backends/{name}/drain")
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "state_unavailable"
            assert "nothing changed" in refused.json()["error"]["message"]
            assert await held(edge) == {name: False}


async def test_a_redis_that_restarts_empty_does_not_undrain_a_backend(redis_prefix: str) -> None:
    """Redis run without persistence (as deploy/ runs it) comes back empty: that is no undrain.
    The edges keep holding, write the drain back and count it; an undrain still undrains."""
    redis = RedisServer()
    try:
        async with SimServer(sim_config("s1")) as s1, SimServer(sim_config("s2")) as s2:
            config = fast_config(
                [s1.url, s2.url], share_drains=True, drains_interval=0.1,
                drains_key=redis_prefix + "drains",
            )  # fmt: skip
            name = s1.url.partition("//")[2]
            async with (
                run_edge(config, redis_url=redis.url) as a,
                run_edge(config, redis_url=redis.url) as b,
            ):
                holds = [h for h in (a.wiring.holds, b.wiring.holds) if h is not None]
                assert len(holds) == 2
                assert (await post(a, f"/backends/{name}/drain")).status_code == 200
                await wait_until(lambda: b.wiring.registry.get(name).held)  # type: ignore[union-attr]
                redis.stop()
                redis = RedisServer(port=redis.port)  # back, empty
                await wait_until(lambda: sum(h.restored for h in holds) >= 1)
                async with aioredis.Redis.from_url(redis.url) as direct:
                    assert await direct.hexists(config.drains_key, name)
                await asyncio.sleep(0.5)  # several reads of the hash later
                assert (await held(a))[name] and (await held(b))[name]
                restored = [generate_latest(e.registry).decode() for e in (a, b)]
                assert any("quicedge_drains_restored_total 1.0" in text for text in restored)
                assert (await post(b, f"/backends/{name}/undrain")).status_code == 200
                await wait_until(lambda: not a.wiring.registry.get(name).held)  # type: ignore[union-attr]
                await asyncio.sleep(0.3)
                assert not (await held(a))[name] and not (await held(b))[name]
    finally:
        redis.stop()


async def test_a_drain_whose_answer_is_late_is_read_back_not_called_unchanged(
    redis_url: str, redis_prefix: str
) -> None:
    """The write reached Redis but its answer came after `timeout`: the edge reads the field
    back and answers as Redis has it; when that read is late too, the 503 says the change may
    have been applied (it was) instead of "nothing changed"."""
    async with (
        SimServer(sim_config("s1")) as s1,
        SimServer(sim_config("s2")) as s2,
        SilentRelay(redis_url) as relay,
    ):
        key = redis_prefix + "drains"
        config = fast_config([s1.url, s2.url], share_drains=True, drains_interval=3600.0,
                             drains_key=key)  # fmt: skip
        other = fast_config([s1.url, s2.url], share_drains=True, drains_interval=0.1,
                            drains_key=key)  # fmt: skip
        name = s1.url.partition("//")[2]
        async with (
            run_edge(config, redis_url=relay.url) as a,
            run_edge(other, redis_url=redis_url) as b,
            aioredis.Redis.from_url(redis_url) as direct,
        ):
            relay.slow_after, relay.reply_delay = (b"MULTI",), 0.8  # the write's answer is late
            drained = await post(a, f"/backends/{name}/drain")
            assert drained.status_code == 200 and drained.json()["held"] is True
            await wait_until(lambda: b.wiring.registry.get(name).held)  # type: ignore[union-attr]
            # Now the read back is late too: the edge cannot tell.
            relay.slow_after = (b"MULTI", b"HEXISTS")
            refused = await post(a, f"/backends/{name}/undrain")
            assert refused.status_code == 503
            message = refused.json()["error"]["message"]
            assert "may have been applied" in message and "nothing changed" not in message
            assert not await direct.hexists(key, name)  # it was
            await wait_until(lambda: not b.wiring.registry.get(name).held)  # type: ignore[union-attr]


async def test_a_drain_announced_while_the_subscription_was_silently_dead_is_read_at_once(
    redis_url: str, redis_prefix: str
) -> None:
    """A's connections die without a close and B drains meanwhile. With an hour between reads
    of the hash, only PING (finding the dead subscription) and the read that follows a new
    subscription can bring the drain to A."""
    async with (
        SimServer(sim_config("s1")) as s1,
        SimServer(sim_config("s2")) as s2,
        SilentRelay(redis_url) as relay,
    ):
        config = fast_config([s1.url, s2.url], share_drains=True, drains_interval=3600.0,
                             drains_key=redis_prefix + "drains")  # fmt: skip
        name = s1.url.partition("//")[2]
        async with (
            run_edge(config, redis_url=relay.url, start=False) as a,
            run_edge(config, redis_url=redis_url) as b,
        ):
            holds = a.wiring.holds
            assert holds is not None
            holds.ping_interval = holds.ping_timeout = 0.25
            await a.wiring.start()
            await asyncio.wait_for(holds.subscribed.wait(), 10)
            assert relay.sever() > 0
            assert (await post(b, f"/backends/{name}/drain")).status_code == 200
            await wait_until(lambda: a.wiring.registry.get(name).held, timeout=10)  # type: ignore[union-attr]
            assert holds.subscription is not None
            assert holds.subscription.failures["silent"] >= 1
