"""Health checks and load polls against a backend that answers slowly, with garbage or with a
huge body: each is bounded in time and memory, and one endpoint's trouble is not another's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from backends.registry import BackendRegistry, HealthConfig
from backends.sglang import MAX_RESPONSE_BYTES
from tests.helpers import wait_until

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]

LOADS = b'{"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 10}]}'


async def ok(writer: asyncio.StreamWriter, body: bytes = b"ok") -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


async def hang(writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()


async def huge(writer: asyncio.StreamWriter) -> None:
    size = 4 * MAX_RESPONSE_BYTES
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
    block = b"[" * 65536
    for _ in range(size // len(block)):
        writer.write(block)
        await writer.drain()


async def garbage(writer: asyncio.StreamWriter) -> None:
    writer.write(b"\x00\x01 not http at all\r\n\r\n")
    await writer.drain()
    writer.close()


class Backend:
    """A stand-in that answers `/health` 200 and `/v1/loads` as told, one request at a time per
    connection, as uvicorn does."""

    def __init__(self, loads: Answer) -> None:
        self.loads = loads
        self.requests: list[str] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                self.requests.append(path)
                if path == "/v1/loads":
                    await self.loads(writer)
                else:
                    await ok(writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def registries() -> AsyncIterator[list[BackendRegistry]]:
    made: list[BackendRegistry] = []
    yield made
    for registry in made:
        await registry.aclose()


def registry_for(url: str, made: list[BackendRegistry], **health: float) -> BackendRegistry:
    config = HealthConfig(
        interval=health.get("interval", 0.05),
        timeout=health.get("timeout", 0.3),
        failure_threshold=2,
        loads_interval=health.get("loads_interval", 0.01),
    )
    registry = BackendRegistry([url], pool=None, health=config)
    made.append(registry)
    return registry


async def test_a_hanging_load_poll_does_not_fail_the_health_checks(
    registries: list[BackendRegistry],
) -> None:
    async with Backend(hang) as url:
        registry = registry_for(url, registries)
        backend = registry.backends[0]
        await registry.start()
        # The load poll hangs for its whole timeout, again and again; /health answers at once.
        await wait_until(lambda: backend.check_successes + backend.check_failures >= 6)
        await wait_until(lambda: backend.load_polls_failed >= 2)
        assert backend.healthy
        assert backend.check_failures == 0


async def test_a_huge_load_answer_is_cut_off_and_counted(
    registries: list[BackendRegistry],
) -> None:
    async with Backend(huge) as url:
        registry = registry_for(url, registries, timeout=5.0, loads_interval=10.0)
        backend = registry.backends[0]
        await registry.poll_load_once(backend)
        assert backend.load_polls_failed == 1 and backend.load is None
        await registry.check_once(backend)
        assert backend.check_successes == 1


async def test_a_garbage_load_answer_is_a_failed_poll_and_the_next_one_reconnects(
    registries: list[BackendRegistry],
) -> None:
    answers: list[Answer] = [garbage, lambda writer: ok(writer, LOADS)]

    async def first_garbage_then_loads(writer: asyncio.StreamWriter) -> None:
        await answers.pop(0)(writer)

    async with Backend(first_garbage_then_loads) as url:
        registry = registry_for(url, registries, loads_interval=10.0)
        backend = registry.backends[0]
        await registry.poll_load_once(backend)
        assert backend.load_polls_failed == 1 and backend.load is None
        await registry.poll_load_once(backend)
        assert backend.load is not None and backend.load.num_running_reqs == 1
        assert backend.load_polls_failing == 0


async def test_the_default_health_deadline_outlasts_sglangs_check() -> None:
    """SGLang's `/health` answers after a second or more (it sleeps 1 s, then looks whether its
    scheduler answered a one-token probe). With the default deadline the backend stays healthy,
    and its load polls, which wait behind a check on the same connection, still answer."""
    from backends.sim import SimConfig, SimServer
    from edge.config import ProxyConfig
    from tests.edge.conftest import fast_config, run_edge

    default = ProxyConfig(backends=["http://127.0.0.1:1"]).health_timeout
    async with SimServer(SimConfig(name="s", port=0, profile="instant", health_poll=1.0)) as sim:
        config = fast_config([sim.url], health_timeout=default, loads_interval=0.1)
        async with run_edge(config) as edge:
            backend = edge.wiring.registry.backends[0]
            assert sim.api is not None
            polls = sim.api.requests["/v1/loads"]
            await asyncio.sleep(2.6)  # two checks past a 1 s deadline would mark it down
            assert backend.healthy
            assert sim.api.requests["/v1/loads"] > polls
            assert backend.load_polls_failing == 0
