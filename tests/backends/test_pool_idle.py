"""Idle upstream connections: the pool closes them before the backend would, learns a shorter
`Keep-Alive: timeout` from the backend, and an idle fleet does not reconnect in a loop."""

from __future__ import annotations

from backends.pool import UpstreamPool, keep_alive_timeout
from backends.sim import SimConfig, SimServer
from tests.edge.conftest import Reply, TinyUpstream, client, fast_config, run_edge
from tests.helpers import wait_until


def test_keep_alive_timeout_is_read_from_the_header() -> None:
    assert keep_alive_timeout([(b"keep-alive", b"timeout=5, max=1000")]) == 5.0
    assert keep_alive_timeout([(b"Keep-Alive", b"max=10,timeout=2.5")]) == 2.5
    assert keep_alive_timeout([(b"keep-alive", b"timeout=soon")]) is None
    assert keep_alive_timeout([(b"content-type", b"text/plain")]) is None


async def test_the_pool_learns_a_shorter_keep_alive_from_the_backend() -> None:
    def answer(recorded: object) -> Reply:
        headers = [("keep-alive", "timeout=2"), ("content-type", "application/json")]
        return Reply(chunks=[b"{}"], chunked=False, headers=headers)

    async with TinyUpstream(answer) as up:
        pool = UpstreamPool(idle_timeout=4.0)
        try:
            response = await pool.request(up.url, "GET", "/x", headers=(), body=b"")
            await response.read()
            host = pool._hosts[up.url.rstrip("/")]
            assert host.idle_timeout == 1.0  # a second below the backend's 2 s
            assert len(host.idle) == 1
            await wait_until(lambda: len(host.idle) == 0, timeout=10)  # closed by the edge
        finally:
            await pool.aclose()


async def test_an_idle_fleet_does_not_reconnect_in_a_loop() -> None:
    """The stand-in closes idle connections after 0.5 s, the pool after 0.3 s; health checks run
    every 0.1 s. Once the last request is older than the idle timeout and the warm set has
    expired, many health checks later, the pool has opened nothing more."""
    sim_config = SimConfig(name="i", port=0, profile="instant", timeout_keep_alive=0.5)
    async with SimServer(sim_config) as sim:
        config = fast_config([sim.url], pool_warm_connections=2, pool_idle_timeout=0.3)
        async with run_edge(config) as edge:
            pool = edge.wiring.pool
            assert sim.api is not None
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with client(edge) as http:
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            url = sim.url.rstrip("/")
            checks = sim.api.requests["/health"]
            # ten checks (at least a second: past the 0.3 s idle timeout), then the warm set
            # (topped up after that request) expires and no connect is under way
            await wait_until(lambda: sim.api.requests["/health"] >= checks + 10, timeout=20)

            def quiet() -> bool:
                stats = pool.stats().backends[url]
                return stats.idle + stats.active == 0

            await wait_until(quiet, timeout=20)
            connects = pool.stats().connects
            checks = sim.api.requests["/health"]
            # every one of these checks would have reopened the warm set before
            await wait_until(lambda: sim.api.requests["/health"] >= checks + 10, timeout=20)
            assert pool.stats().connects == connects
            assert edge.wiring.registry.backends[0].healthy
            reused = pool.stats().reused
            async with client(edge) as http:  # and the next request still works
                r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200
            # It paid a connect of its own (nothing warm was left to reuse); the warm set it
            # tops up afterwards may already be open too, and is at most its two.
            after = pool.stats()
            assert after.reused == reused
            assert connects + 1 <= after.connects <= connects + 1 + 2
