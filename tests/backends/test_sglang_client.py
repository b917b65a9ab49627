"""SGLangClient against the stand-in over real sockets (and against a server that hangs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from backends.sglang import LoadSnapshot, SGLangClient, SGLangError, launch_command, parse_loads
from backends.sim import SimConfig, SimServer
from tests.helpers import free_port, wait_until


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    config = SimConfig(
        port=0,
        profile="h100-llama3-8b",
        max_running_requests=2,
        enable_metrics=True,
        enable_cache_report=True,
        timeout_keep_alive=0.2,
    )
    async with SimServer(config) as s:
        yield s


def start_long_requests(
    client: httpx.AsyncClient, url: str, count: int
) -> list[asyncio.Task[httpx.Response]]:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
    tasks = [
        asyncio.create_task(client.post(f"{url}/generate", json={**body, "rid": f"long-{i}"}))
        for i in range(count)
    ]
    return tasks


async def until_loads(client: SGLangClient, running: int, waiting: int) -> LoadSnapshot:
    for _ in range(500):
        snap = await client.loads()
        if (snap.num_running_reqs, snap.num_waiting_reqs) == (running, waiting):
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError(f"loads never reached {running}/{waiting}: {snap}")


async def test_health_models_and_idle_loads(server: SimServer) -> None:
    async with SGLangClient(server.url) as client:
        assert await client.health()
        models = await client.models()
        assert models["data"][0]["id"] == server.config.model_name
        snap = await client.loads()
        assert snap.num_running_reqs == 0 and snap.num_waiting_reqs == 0
        assert snap.max_total_tokens == 420_000


async def test_loads_metrics_and_abort_while_running(server: SimServer) -> None:
    async with httpx.AsyncClient(timeout=30) as http, SGLangClient(server.url) as client:
        tasks = start_long_requests(http, server.url, 3)
        snap = await until_loads(client, running=2, waiting=1)
        assert snap.num_total_tokens > 0 and 0 < snap.token_usage < 1
        metrics = await client.metrics()
        label = f'{{model_name="{server.config.model_name}"}}'
        assert metrics[f"sglang:num_running_reqs{label}"] == 2
        assert metrics[f"sglang:num_queue_reqs{label}"] == 1
        assert f"sglang:prompt_tokens_total{label}" in metrics
        assert any(k.startswith("sglang:time_to_first_token_seconds_bucket") for k in metrics)
        for i in range(3):
            assert await client.abort(f"long-{i}")
        replies = await asyncio.gather(*tasks)
        # SGLang's graceful abort: a 200 whose finish_reason is an abort
        assert all(r.status_code == 200 for r in replies)
        assert all(r.json()["meta_info"]["finish_reason"]["type"] == "abort" for r in replies)
        await until_loads(client, running=0, waiting=0)


async def test_reconnects_after_server_closed_idle_connection(server: SimServer) -> None:
    async with SGLangClient(server.url) as client:
        assert (await client.loads()).num_running_reqs == 0
        # the server's 0.2 s keep-alive closes our socket
        await wait_until(lambda: not server._connections)
        assert (await client.loads()).num_running_reqs == 0


async def test_unreachable_server() -> None:
    async with SGLangClient(f"http://127.0.0.1:{free_port()}", timeout=1.0) as client:
        assert not await client.health()
        assert client.health_error is not None and "127.0.0.1" in client.health_error
        with pytest.raises(SGLangError):
            await client.loads()


async def test_hanging_server_times_out() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers
        writer.close()

    srv = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout=0.2) as client:
            with pytest.raises(SGLangError, match="no answer"):
                await client.models()
            assert not await client.health()
    finally:
        srv.close()
        await srv.wait_closed()


async def test_health_false_while_starting() -> None:
    config = SimConfig(port=0, startup_delay=30.0)
    async with SimServer(config) as s, SGLangClient(s.url) as client:
        assert not await client.health()


async def test_metrics_need_enable_metrics() -> None:
    async with SimServer(SimConfig(port=0)) as s, SGLangClient(s.url) as client:
        with pytest.raises(SGLangError, match="enable-metrics"):
            await client.metrics()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="http://"):
        SGLangClient("ftp://x")
    with pytest.raises(ValueError, match="timeout"):
        SGLangClient("http://127.0.0.1:1", timeout=0)


def test_parse_loads_accepts_every_published_shape() -> None:
    new = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 50,
                      "max_total_num_tokens": 100, "token_usage": 0.5}]}  # fmt: skip
    assert parse_loads(new) == LoadSnapshot(3, 2, 50, 0.5, 100)
    legacy = [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 40}]
    assert parse_loads(legacy) == LoadSnapshot(3, 2, 40, 0.0, None)
    two_ranks = {"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 10,
                            "max_total_num_tokens": 100},
                           {"num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 30,
                            "max_total_num_tokens": 100}]}  # fmt: skip
    assert parse_loads(two_ranks) == LoadSnapshot(3, 1, 40, 0.2, 200)
    assert parse_loads({"load": 7}).num_running_reqs == 7
    with pytest.raises(SGLangError):
        parse_loads({"nothing": 1})
    with pytest.raises(SGLangError):
        parse_loads([])


def test_launch_command_has_the_flags_quicedge_needs() -> None:
    argv = launch_command(port=31000)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--enable-metrics" in argv and "--enable-cache-report" in argv
    assert argv[argv.index("--port") + 1] == "31000"
