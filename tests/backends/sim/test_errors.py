"""Every bad input gets a clear SGLang-style error (and nothing is left running)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from tests.backends.sim.conftest import MakeSim

OPENAI_ERROR_KEYS = {"object", "message", "type", "param", "code"}


async def raw_exchange(server: SimServer, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", b"{not json", "malformed JSON"),
        ("/generate", b"[1, 2]", "JSON object"),
        ("/generate", b"", "empty"),
        ("/generate", b"{}", "Either text or input_ids"),
        ("/generate", b'{"text": "a", "input_ids": [1]}', "Only one of"),
        ("/generate", b'{"text": 5}', "'text' must be a string"),
        ("/generate", b'{"input_ids": [1, -2]}', "non-negative"),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', "at least 0"),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": "9"}}', "integer"),
        ("/generate", b'{"text": "a", "sampling_params": {"temperature": -1}}', "temperature"),
        ("/generate", b'{"text": "a", "sampling_params": {"stop": 3}}', "'stop'"),
        ("/generate", b'{"text": "a", "stream": "yes"}', "boolean"),
        ("/generate", b'{"text": ["a", 1]}', "list of strings"),
        ("/generate", b'{"text": ["a", "b"], "sampling_params": [{}]}', "one per prompt"),
        ("/generate", b'{"text": "a", "sampling_params": []}', "sampling_params"),
    ],
)
async def test_generate_bad_input(
    sim: SimServer, client: httpx.AsyncClient, path: str, body: bytes, needle: str
) -> None:
    r = await client.post(f"{sim.url}{path}", content=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "non-empty"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "object"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {}},
            "stream=True",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "'n'"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 200_000}, "context length"),
        ("/v1/completions", {"prompt": []}, "empty"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ],
)
async def test_openai_bad_input(
    sim: SimServer, client: httpx.AsyncClient, path: str, body: dict[str, object], needle: str
) -> None:
    r = await client.post(f"{sim.url}{path}", json=body)
    assert r.status_code == 400
    error = r.json()
    assert set(error) == OPENAI_ERROR_KEYS
    assert error["object"] == "error" and error["code"] == 400
    assert needle in error["message"]


async def test_openai_routes_require_json_content_type(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    r = await client.post(
        f"{sim.url}/v1/completions",
        content=b'{"prompt": "x"}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 400
    assert "application/json" in r.json()["message"]


async def test_malformed_json_on_openai_route(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.post(
        f"{sim.url}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "malformed JSON" in r.json()["message"]


async def test_unknown_route_and_wrong_method(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.get(f"{sim.url}/v2/nothing")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = await client.get(f"{sim.url}/generate")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = await client.get(f"{sim.url}/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_metrics_absent_without_flag(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    server = await make_sim(enable_metrics=False)
    r = await client.get(f"{server.url}/metrics")
    assert r.status_code == 404


async def test_oversize_body_by_content_length(make_sim: MakeSim) -> None:
    server = await make_sim(max_body_bytes=4096)
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999\r\n\r\n"
    reply = await raw_exchange(server, head)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"exceeds" in reply


async def test_oversize_chunked_body(make_sim: MakeSim) -> None:
    server = await make_sim(max_body_bytes=4096)
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (1000, b"x" * 1000)
    reply = await raw_exchange(server, head + chunk * 6)
    assert reply.startswith(b"HTTP/1.1 413 ")


async def test_oversize_headers_get_431(sim: SimServer) -> None:
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n"
    reply = await raw_exchange(sim, head)
    assert reply.startswith(b"HTTP/1.1 431 ")


async def test_garbage_request_line_gets_400(sim: SimServer) -> None:
    reply = await raw_exchange(sim, b"\x16\x03\x01 hello\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")


async def test_prompt_longer_than_context(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    server = await make_sim(context_length=64)
    r = await client.post(f"{server.url}/generate", json={"input_ids": list(range(100))})
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]


async def test_abort_request_needs_rid(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.post(f"{sim.url}/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    r = await client.post(f"{sim.url}/abort_request", json={"rid": "unknown"})
    assert r.status_code == 200  # like SGLang: unknown ids are not an error


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown profile"):
        SimConfig(profile="a100-nope")
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=-1)
    with pytest.raises(ValueError, match="page_size"):
        SimConfig(page_size=0)
    with pytest.raises(ValueError, match="max_running_requests"):
        SimConfig(max_running_requests=0)
    with pytest.raises(ValueError, match="natural_output_len"):
        SimConfig(natural_output_len=(5, 2))


async def test_expect_100_continue(sim: SimServer) -> None:
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}'
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim.startswith(b"HTTP/1.1 100 ")
    writer.write(body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.close()


async def test_duplicate_rid_in_flight(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    server = await make_sim(profile="h100-llama3-8b")
    body = {"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 100_000}}
    first = asyncio.create_task(client.post(f"{server.url}/generate", json=body))
    for _ in range(500):  # wait until the first one is in
        loads = (await client.get(f"{server.url}/v1/loads")).json()["loads"][0]
        if loads["num_running_reqs"] == 1:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the first request never started")
    r = await client.post(f"{server.url}/generate", json=body)
    assert r.status_code == 400
    assert "Duplicate request ID: dup" in r.json()["error"]["message"]
    await client.post(f"{server.url}/abort_request", json={"rid": "dup"})
    answer = await first
    assert answer.status_code == 200
    assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
