"""The backend registry: in-flight accounting, passive ejection, degradation, active checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from backends.errors import UpstreamError
from backends.pool import UpstreamPool
from backends.registry import BackendRegistry, HealthConfig, LoadView
from tests.helpers import wait_until


class FakeClock:
    """Time passed in, so ejection backoff runs in zero wall time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


def make(**kw: object) -> tuple[BackendRegistry, FakeClock]:
    clock = FakeClock()
    health = kw.pop("health", HealthConfig(eject_after=3, eject_base_s=1.0, eject_max_s=4.0))
    registry = BackendRegistry(URLS, pool=None, health=health, clock=clock, **kw)  # type: ignore[arg-type]
    return registry, clock


def load(*, usage: float = 0.1, waiting: int = 0) -> LoadView:
    return LoadView(
        num_running_reqs=1,
        num_waiting_reqs=waiting,
        num_total_tokens=10,
        token_usage=usage,
        max_total_tokens=1000,
    )


def test_track_counts_and_restores_on_success() -> None:
    registry, _ = make()
    b = registry.backends[0]
    with registry.track(b, prefill_tokens=100) as in_flight:
        assert (b.in_flight, b.in_flight_prefill_tokens, b.in_prefill) == (1, 100, 1)
        with registry.track(b, prefill_tokens=50):
            assert (b.in_flight, b.in_flight_prefill_tokens) == (2, 150)
        in_flight.first_token()
        in_flight.first_token()  # idempotent
        assert (b.in_flight, b.in_flight_prefill_tokens, b.in_prefill) == (1, 0, 0)
    assert (b.in_flight, b.in_flight_prefill_tokens, b.in_prefill) == (0, 0, 0)
    assert b.requests == 2


def test_track_restores_counts_when_the_block_raises() -> None:
    registry, _ = make()
    b = registry.backends[1]
    with pytest.raises(UpstreamError), registry.track(b, prefill_tokens=70):
        raise UpstreamError("backend died mid-stream")
    assert (b.in_flight, b.in_flight_prefill_tokens, b.in_prefill) == (0, 0, 0)


async def test_track_restores_counts_when_the_task_is_cancelled() -> None:
    registry, _ = make()
    b = registry.backends[2]
    entered = asyncio.Event()

    async def request() -> None:
        with registry.track(b, prefill_tokens=10):
            entered.set()
            await asyncio.sleep(3600)  # a client that goes away cancels this

    task = asyncio.create_task(request())
    await entered.wait()
    assert b.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (b.in_flight, b.in_flight_prefill_tokens) == (0, 0)


def test_negative_prefill_tokens_count_as_zero() -> None:
    registry, _ = make()
    b = registry.backends[0]
    with registry.track(b, prefill_tokens=-5):
        assert b.in_flight_prefill_tokens == 0
    assert b.in_flight_prefill_tokens == 0


def test_passive_ejection_backs_off_exponentially_and_returns() -> None:
    registry, clock = make()
    b = registry.backends[0]
    for _ in range(2):
        registry.record_failure(b, "connect")
    assert b in registry.candidates()
    registry.record_failure(b, "5xx")  # third in a row
    assert b not in registry.candidates()
    clock.now += 1.01
    assert b in registry.candidates()  # back after the first ejection (1 s)
    for _ in range(3):
        registry.record_failure(b, "timeout")
    clock.now += 1.5
    assert b not in registry.candidates()  # second ejection lasts 2 s
    clock.now += 0.6
    assert b in registry.candidates()
    for _ in range(3 * 3):
        registry.record_failure(b, "protocol")  # third and fourth: 4 s, capped at eject_max_s
    assert b.ejected_until == pytest.approx(clock.now + 4.0)
    registry.record_success(b, ttft_s=0.01)
    assert b.ejections_in_a_row == 0 and b.consecutive_failures == 0


def test_ejections_without_end_stay_at_the_cap_and_never_overflow() -> None:
    """A backend that fails every request while its health check passes is ejected again and
    again (each `eject_max_s` at most): the 1,024th doubling of `eject_base_s` is past what a
    float holds, and raised OverflowError on the request path."""
    registry, clock = make()
    b = registry.backends[0]
    for _ in range(1100):
        for _ in range(3):
            registry.record_failure(b, "5xx")
        ejected_for = b.ejected_until - clock.now
        assert ejected_for == pytest.approx(4.0 if b.ejections_in_a_row > 3 else ejected_for)
        clock.now = b.ejected_until
    assert b.ejections_in_a_row == 1100


def test_a_success_resets_the_consecutive_failure_count() -> None:
    registry, _ = make()
    b = registry.backends[0]
    for _ in range(5):
        registry.record_failure(b, "connect")
        registry.record_failure(b, "connect")
        registry.record_success(b, ttft_s=None)
    assert b in registry.candidates()
    assert b.failures == {"connect": 10}


def test_client_errors_do_not_eject() -> None:
    registry, _ = make()
    b = registry.backends[0]
    for _ in range(10):
        registry.record_failure(b, "4xx")
        registry.record_failure(b, "429")
        registry.record_failure(b, "disconnect")
    assert b in registry.candidates()


def test_unknown_failure_kind_is_an_error() -> None:
    registry, _ = make()
    with pytest.raises(ValueError, match="unknown failure kind 'oops'"):
        registry.record_failure(registry.backends[0], "oops")


def test_concurrency_cap_removes_a_full_backend() -> None:
    registry, _ = make(max_concurrency=2)
    b = registry.backends[0]
    with registry.track(b, prefill_tokens=1), registry.track(b, prefill_tokens=1):
        assert b not in registry.candidates()
        assert len(registry.candidates()) == 2
    assert b in registry.candidates()


def test_degraded_backends_are_used_only_when_nothing_else_can() -> None:
    health = HealthConfig(degraded_token_usage=0.9, degraded_queue=5)
    registry, _ = make(health=health)
    a, b, c = registry.backends
    registry.set_load(a, load(usage=0.95))
    registry.set_load(b, load(waiting=6))
    assert a.degraded and "token_usage" in (a.degraded_reason or "")
    assert b.degraded and "queue" in (b.degraded_reason or "")
    assert registry.candidates() == [c]
    c.healthy = False
    assert registry.candidates() == [a, b]  # nothing healthy and non-degraded is left
    registry.set_load(a, load(usage=0.2))
    assert not a.degraded
    assert registry.candidates() == [a]


def test_ttft_p99_degrades_only_with_enough_samples() -> None:
    health = HealthConfig(degraded_ttft_p99_s=0.5, min_ttft_samples=10, degraded_token_usage=None)
    registry, _ = make(health=health)
    b = registry.backends[0]
    for _ in range(9):
        registry.record_success(b, ttft_s=2.0)
    assert not b.degraded
    registry.record_success(b, ttft_s=2.0)
    assert b.degraded and "ttft p99" in (b.degraded_reason or "")
    for _ in range(300):  # the window rolls; fast answers bring it back
        registry.record_success(b, ttft_s=0.05)
    assert not b.degraded and b.ttft_p99() == pytest.approx(0.05)


def test_active_check_thresholds() -> None:
    health = HealthConfig(failure_threshold=2, success_threshold=3)
    registry, _ = make(health=health)
    b = registry.backends[0]
    registry.record_check(b, False)
    assert b.healthy
    registry.record_check(b, False)
    assert not b.healthy and b not in registry.candidates()
    registry.record_check(b, True)
    registry.record_check(b, True)
    assert not b.healthy
    registry.record_check(b, True)
    assert b.healthy


async def test_the_line_that_marks_a_backend_unhealthy_says_what_its_checks_met(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real checks against a port nothing listens on: the reason was at debug level only."""
    health = HealthConfig(failure_threshold=2, timeout=1.0)
    registry = BackendRegistry(["http://127.0.0.1:1"], pool=None, health=health)
    b = registry.backends[0]
    try:
        with caplog.at_level("WARNING", logger="backends.registry"):
            for _ in range(2):
                assert not await registry.check_once(b)
    finally:
        await registry.aclose()
    assert not b.healthy
    [line] = [r.getMessage() for r in caplog.records if "health checks" in r.getMessage()]
    assert line.startswith("backend 127.0.0.1:1 failed 2 health checks (last: ")
    assert "ConnectionRefusedError" in line


def test_snapshot_is_json() -> None:
    registry, clock = make()
    b = registry.backends[0]
    registry.set_load(b, load(usage=0.5))
    registry.record_success(b, ttft_s=0.02)
    for _ in range(3):
        registry.record_failure(registry.backends[1], "connect")
    snap = json.loads(json.dumps(registry.snapshot()))
    assert [s["name"] for s in snap] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert snap[0]["load"]["token_usage"] == 0.5 and snap[0]["ttft_p99_ms"] == 20.0
    assert snap[1]["available"] is False and snap[1]["ejected_for_s"] == pytest.approx(1.0)
    assert snap[1]["failures"] == {"connect": 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": []}, "at least one"),
        ({"urls": ["ftp://x"]}, "http://HOST:PORT"),
        ({"urls": ["http://a:1/v1"]}, "http://HOST:PORT"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "twice"),
        ({"urls": ["http://a:1"], "names": ["x", "y"]}, "names"),
        ({"urls": ["http://a:1", "http://b:1"], "names": ["x", "x"]}, "unique"),
        ({"urls": ["http://a:1"], "max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_registry_arguments(kwargs: dict[str, object], message: str) -> None:
    urls = kwargs.pop("urls")
    with pytest.raises(ValueError, match=message):
        BackendRegistry(urls, pool=None, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "interval"),
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"degraded_token_usage": 1.5}, "token_usage"),
        ({"loads_interval": -1.0}, "loads_interval"),
        ({"degraded_queue": -1}, "degraded_queue"),
    ],
)
def test_bad_health_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HealthConfig(**kwargs)  # type: ignore[arg-type]


# -- active checks over real sockets --------------------------------------------------------


class HealthServer:
    """A backend whose /health and /v1/loads answers the test switches."""

    def __init__(self) -> None:
        self.status = 200
        self.server: asyncio.Server | None = None
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                path = line.split()[1]
                while (await reader.readline()).strip():
                    pass
                if path == b"/v1/loads":
                    entry = {"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 5}
                    body = json.dumps([{**entry, "token_usage": 0.99}]).encode()
                    status = 200
                else:
                    body, status = b"", self.status
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)
                )
                await writer.drain()
        except (ConnectionError, IndexError):
            pass
        finally:
            writer.close()


class PoolProbe:
    """A minimal health/loads client over the real upstream pool (the registry's client seam)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.pool = UpstreamPool(connect_timeout=timeout)

    async def health(self) -> bool:
        response = await self.pool.request(self.url, "GET", "/health", headers=[], body=b"")
        await response.read()
        return response.status == 200

    async def loads(self) -> LoadView:
        response = await self.pool.request(self.url, "GET", "/v1/loads", headers=[], body=b"")
        entry = json.loads(await response.read())[0]
        return LoadView(
            entry["num_reqs"] - entry["num_waiting_reqs"],
            entry["num_waiting_reqs"],
            entry["num_tokens"],
            entry["token_usage"],
            None,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()


@pytest.fixture
async def health_server() -> AsyncIterator[HealthServer]:
    srv = HealthServer()
    srv.server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    srv.port = srv.server.sockets[0].getsockname()[1]
    yield srv
    srv.server.close()
    await srv.server.wait_closed()


async def test_active_checks_eject_and_return(health_server: HealthServer) -> None:
    url = f"http://127.0.0.1:{health_server.port}"
    pool = UpstreamPool()
    health = HealthConfig(
        interval=0.02,
        timeout=1.0,
        failure_threshold=2,
        success_threshold=2,
        loads_interval=0.02,
        degraded_token_usage=0.95,
    )
    registry = BackendRegistry(
        [url], pool=pool, health=health, warm_connections=2, client_factory=PoolProbe
    )
    b = registry.backends[0]
    await registry.start()
    try:
        assert pool.stats().backends[url].idle == 2  # pre-warmed before traffic
        await wait_until(lambda: b.load is not None)
        assert b.load.num_waiting_reqs == 1 and b.degraded  # token_usage 0.99 > 0.95
        health_server.status = 503
        await wait_until(lambda: not b.healthy)
        assert registry.candidates() == []
        health_server.status = 200
        await wait_until(lambda: b.healthy)
        assert registry.candidates() == [b]
    finally:
        await registry.aclose()
        await pool.aclose()


async def test_unreachable_backend_fails_its_checks() -> None:
    from tests.helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    health = HealthConfig(interval=0.02, timeout=0.5, failure_threshold=2, loads_interval=None)
    registry = BackendRegistry([url], pool=None, health=health, client_factory=PoolProbe)
    await registry.start()
    try:
        await wait_until(lambda: not registry.backends[0].healthy)
    finally:
        await registry.aclose()


async def test_health_loop_tops_up_warm_connections_after_traffic() -> None:
    from backends.sim import SimConfig, SimServer

    async with SimServer(SimConfig(name="w", port=0, timeout_keep_alive=0.5)) as sim:
        pool = UpstreamPool()
        health = HealthConfig(interval=0.02, loads_interval=None)
        registry = BackendRegistry([sim.url], pool=pool, health=health, warm_connections=2,
                                   client_factory=PoolProbe)  # fmt: skip
        await registry.start()
        try:
            # the stand-in closes the warm set after 0.5 s idle; no traffic, no new one
            await wait_until(lambda: pool.stats().backends[sim.url].idle == 0)
            connects = pool.stats().connects
            response = await pool.request(sim.url, "GET", "/health", headers=(), body=b"")
            await response.read()
            # after a request, the next passed check tops the warm set up again
            await wait_until(lambda: pool.stats().connects >= connects + 2)
        finally:
            await registry.aclose()
            await pool.aclose()


async def test_default_client_checks_a_stand_in_that_dies_and_returns() -> None:
    """The registry's own SGLang client against the stand-in: healthy, loads polled (KV pool
    size included), unhealthy once it is gone, healthy again when it is back on its port."""
    from backends.sim import SimConfig, SimServer

    sim = SimServer(SimConfig(name="r", port=0, max_total_tokens=5000))
    await sim.start()
    port = sim.port
    health = HealthConfig(interval=0.02, timeout=0.5, failure_threshold=2, success_threshold=2,
                          loads_interval=0.02)  # fmt: skip
    registry = BackendRegistry([sim.url], pool=None, health=health)
    b = registry.backends[0]
    await registry.start()
    try:
        await wait_until(lambda: b.load is not None)
        assert b.load.max_total_tokens == 5000 and b.healthy
        await sim.stop()
        await wait_until(lambda: not b.healthy)
        assert registry.candidates() == []
        sim = SimServer(SimConfig(name="r", port=port))
        await sim.start()
        await wait_until(lambda: b.healthy)
        assert registry.candidates() == [b]
    finally:
        await registry.aclose()
        await sim.stop()


def test_a_backend_being_warmed_is_used_only_when_no_ready_one_can_take_it() -> None:
    registry, clock = make()
    a, b, c = registry.backends
    a.warming_until = clock.now + 5
    assert registry.candidates() == [b, c]
    assert [s["ready"] for s in registry.snapshot()] == [False, True, True]
    b.healthy = c.healthy = False
    assert registry.candidates() == [a]  # nothing ready is left: the warming one serves
    b.healthy = True
    assert registry.candidates() == [b]
    clock.now += 5  # the readiness deadline passed
    assert registry.candidates() == [a, b]


def test_listeners_hear_when_a_backend_is_healthy_again() -> None:
    registry, _ = make(health=HealthConfig(failure_threshold=1, success_threshold=2))
    heard: list[str] = []
    registry.on_healthy.append(lambda backend: heard.append(backend.url))
    b = registry.backends[1]
    registry.record_check(b, True)
    assert heard == []  # it never failed
    registry.record_check(b, False)
    registry.record_check(b, True)
    assert heard == []
    registry.record_check(b, True)
    assert heard == [b.url]
