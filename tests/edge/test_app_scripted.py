"""The app against small scripted upstreams that record what they got: forwarded headers and body,
retries only before the first byte, mid-stream death, timeouts, and every bad input."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest

from backends.registry import Backend
from edge.errors import PayloadTooLarge
from edge.relay import StreamRelay
from edge.routing.base import Decision, RequestView
from edge.routing.simple import RoundRobin
from tests.edge.conftest import (
    LISTENERS,
    Edge,
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    held_sse,
    run_edge,
    sse_reply,
)
from tests.helpers import settled, wait_until
from tests.transport.test_h1_server import read_response

COMPLETION = {"model": "tiny-model", "prompt": "Hello there", "stream": True}


def script(on_request: Callable[[Recorded], Reply]) -> Callable[[Recorded], Reply]:
    def answer(recorded: Recorded) -> Reply:
        return health_ok(recorded) or on_request(recorded)

    return answer


def inference(upstream: TinyUpstream) -> list[Recorded]:
    return [r for r in upstream.requests if r.path.startswith(("/v1/c", "/generate"))]


def sample(metrics: str, name: str) -> int:
    """One sample's value in a `/metrics` text (0 when it is absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return int(float(line.rpartition(" ")[2]))
    return 0


def in_flight(edge: Edge) -> list[int]:
    return [b.in_flight for b in edge.wiring.registry.backends]


async def test_forwards_body_with_rid_and_headers_and_names_the_backend() -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["Hi", " there"]))) as up:
        config = fast_config([up.url], expose_backend_names=True)
        async with run_edge(config) as edge, client(edge) as http:
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            response = await http.post(
                "/v1/completions",
                json=COMPLETION,
                headers={"x-request-id": "req-42", "traceparent": traceparent},
            )
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "req-42"
            assert response.headers["x-quicedge-backend"] == edge.wiring.registry.backends[0].name
            assert response.headers["content-type"] == "text/event-stream"
            assert b'"Hi"' in response.content and response.content.endswith(b"data: [DONE]\n\n")
    (sent,) = inference(up)
    # the client's id labels the answer; the backend gets the edge's own as its rid
    rid = json.loads(sent.body)["rid"]
    assert rid != "req-42" and len(rid) == 32
    # and a stream's usage chunk, which the edge reads and keeps from this client (`forward`)
    asked = {"stream_options": {"include_usage": True}}
    assert json.loads(sent.body) == {"rid": rid, **COMPLETION, **asked}
    assert sent.headers["x-request-id"] == "req-42"  # the label, which SGLang does not read
    assert sent.headers["traceparent"] == traceparent  # tracing off: passed through unchanged
    assert "early-data" not in sent.headers


async def test_a_body_rid_labels_the_request_but_is_not_sent_as_the_rid() -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["ok"]))) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json={**COMPLETION, "rid": "mine"})
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "mine"
    (sent,) = inference(up)
    assert json.loads(sent.body)["rid"] not in ("mine", "")
    assert sent.headers["x-request-id"] == "mine"


async def test_an_error_after_parsing_carries_the_body_rid_label() -> None:
    async def slow(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        await asyncio.sleep(3)
        return sse_reply(["late"])

    async with TinyUpstream(slow) as up:
        config = fast_config([up.url], first_byte_timeout=0.3)
        async with run_edge(config) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json={**COMPLETION, "rid": "mine"})
            assert response.status_code == 504  # an EdgeError, rendered at the boundary
            assert response.headers["x-request-id"] == "mine"


async def test_early_data_request_is_forwarded_with_early_data_header() -> None:
    """Drive the app with the scope the H3 transport gives a 0-RTT request."""
    async with TinyUpstream(script(lambda r: sse_reply(["ok"]))) as up:
        async with run_edge(fast_config([up.url])) as edge:
            body = json.dumps(COMPLETION).encode()
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "http_version": "3",
                "headers": [(b"content-type", b"application/json")],
                "extensions": {"transport": "h3", "early_data": True, "handshake_wait_s": 0.0},
            }
            messages = [{"type": "http.request", "body": body, "more_body": False}]
            done = asyncio.Event()
            sent: list[dict[str, object]] = []

            async def receive() -> dict[str, object]:
                if messages:
                    return messages.pop(0)
                await done.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, object]) -> None:
                sent.append(message)

            await edge.wiring.app(scope, receive, send)
            done.set()
            assert sent[0]["status"] == 200
            metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
            assert 'early_data="0rtt"' in metrics and 'transport="h3"' in metrics
    (forwarded,) = inference(up)
    assert forwarded.headers["early-data"] == "1"


async def test_the_end_of_a_whole_response_is_not_a_client_going_away() -> None:
    """Once the response is complete, `receive` answers `http.disconnect` (ASGI). A send of the
    last chunk that yields to the loop lets the watcher see it; the request must still be
    accounted as served, not cancelled, counted as a disconnect and aborted upstream."""
    async with TinyUpstream(script(lambda r: sse_reply(["ok"]))) as up:
        async with run_edge(fast_config([up.url])) as edge:
            body = json.dumps(COMPLETION).encode()
            scope = {
                "type": "http", "method": "POST", "path": "/v1/completions",
                "http_version": "1.1", "headers": [(b"content-type", b"application/json")],
            }  # fmt: skip
            messages = [{"type": "http.request", "body": body, "more_body": False}]
            responded = asyncio.Event()

            async def receive() -> dict[str, object]:
                if messages:
                    return messages.pop(0)
                await responded.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, object]) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    responded.set()
                    for _ in range(3):  # a server whose send waits, e.g. for a drain
                        await asyncio.sleep(0)

            await edge.wiring.app(scope, receive, send)
            metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
            assert "quicedge_client_disconnects_total 0.0" in metrics
            served = 'model="tiny-model",route="/v1/completions",status="200"'
            assert f"quicedge_requests_total{{{served}}} 1.0" in metrics
            assert "quicedge_ttft_seconds_count" in metrics
            assert in_flight(edge) == [0]
    assert not any(r.path == "/abort_request" for r in up.requests)


async def test_503_is_retried_on_the_other_backend() -> None:
    busy = script(lambda r: Reply(status=503, chunks=[b'{"error":"busy"}'], chunked=False))
    async with TinyUpstream(busy) as bad, TinyUpstream(script(lambda r: sse_reply(["x"]))) as good:
        config = fast_config(
            [bad.url, good.url], policy="round_robin", eject_after_failures=100,
            expose_backend_names=True,
        )  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            for _ in range(4):
                response = await http.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200
                assert response.headers["x-quicedge-backend"] == f"127.0.0.1:{good.port}"
            metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
            assert 'quicedge_retries_total{reason="503"}' in metrics
            assert in_flight(edge) == [0, 0]
    assert len(inference(good)) == 4
    assert 1 <= len(inference(bad)) <= 4


@pytest.mark.parametrize(
    "refusal",
    [
        Reply(status=503, chunks=[b"x" * 16384] * 1024),  # 16 MiB: more than sockets hold
        Reply(status=503, chunks=[b"busy"] * 3, delay=2.0),  # 6 s: past the client's 5 s
    ],
    ids=["large", "slow"],
)
async def test_a_refusals_body_larger_or_slower_than_a_refusals_costs_its_connection(
    refusal: Reply,
) -> None:
    """Before its retry, the edge read the whole body of a 503, to keep its connection: a
    400 MB one took 800 MiB of memory, and one that trickled held the client for ever."""
    async with (
        TinyUpstream(script(lambda r: refusal)) as bad,
        TinyUpstream(script(lambda r: sse_reply(["x"]))) as good,
    ):
        config = fast_config([bad.url, good.url], eject_after_failures=100, chunk_timeout=30.0)
        async with run_edge(config) as edge, client(edge, timeout=5.0) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            assert response.headers["x-quicedge-backend"] == f"127.0.0.1:{good.port}"
            if not refusal.delay:  # the large one: its writes meet the closed connection
                await wait_until(lambda: bool(bad.replies_cut))
            assert in_flight(edge) == [0, 0]
    assert bad.body_bytes_sent.get("/v1/completions", 0) < 16 << 20


async def test_a_non_streamed_answer_must_be_whole_within_the_chunk_timeout_of_its_head() -> None:
    """Each piece within the chunk timeout, the whole not: before, only the gaps were bounded."""
    pieces = [b'{"choices": [', *[b" " for _ in range(10)], b"]}"]
    trickle = script(lambda r: Reply(chunks=pieces, delay=0.2, chunked=False))
    async with TinyUpstream(trickle) as up:
        async with run_edge(fast_config([up.url], chunk_timeout=0.6)) as edge, client(edge) as h:
            response = await h.post("/v1/completions", json={**COMPLETION, "stream": False})
            assert response.status_code == 504
            error = response.json()["error"]
            assert error["code"] == "upstream_timeout"
            assert "not whole within 0.6s of its head" in error["message"]
            assert in_flight(edge) == [0]


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "counted"])
async def test_a_non_streamed_answer_over_the_limit_is_a_502_that_says_so(
    monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    monkeypatch.setattr("edge.attempt.MAX_UPSTREAM_BODY", 1000)
    big = script(lambda r: Reply(chunks=[b"x" * 600] * 2, chunked=chunked))
    async with TinyUpstream(big) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json={**COMPLETION, "stream": False})
            assert response.status_code == 502
            message = response.json()["error"]["message"]
            assert "over 1000" in message and "no larger non-streamed answer" in message
            assert in_flight(edge) == [0]


async def test_when_every_backend_says_503_the_client_gets_the_last_answer() -> None:
    busy = script(lambda r: Reply(status=503, chunks=[b'{"error":"busy"}'], chunked=False))
    async with TinyUpstream(busy) as a, TinyUpstream(busy) as b:
        config = fast_config([a.url, b.url], eject_after_failures=100)
        async with run_edge(config) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 503
            assert response.content == b'{"error":"busy"}'
    assert len(inference(a)) + len(inference(b)) == 2  # each backend tried once


@pytest.mark.parametrize("budget", [0.2, 1.0])
async def test_the_retry_budget_bounds_the_retries_of_a_fleet_that_says_503(budget: float) -> None:
    """Ten requests at once against three backends that all answer 503 after half a second: within
    a 20 % budget (at least one), two go on a retry and eight are answered as they failed; with
    the budget off, every one tries all three backends."""
    slow_busy = script(lambda r: Reply(status=503, chunks=[b'{"error":"busy"}'], chunked=False,
                                       delay=0.5))  # fmt: skip
    async with (
        TinyUpstream(slow_busy) as a, TinyUpstream(slow_busy) as b, TinyUpstream(slow_busy) as c,
    ):  # fmt: skip
        config = fast_config(
            [a.url, b.url, c.url], eject_after_failures=1000, retry_budget=budget,
            retry_budget_min=1, pool_max_connections=32,
        )  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            answers = await asyncio.gather(
                *(http.post("/v1/completions", json=COMPLETION) for _ in range(10))
            )
            assert {r.status_code for r in answers} == {503}
            metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
            assert in_flight(edge) == [0, 0, 0]
        exhausted = sample(metrics, "quicedge_retry_budget_exhausted_total")
        retries = sample(metrics, 'quicedge_retries_total{reason="503"}')
    attempts = sum(len(inference(u)) for u in (a, b, c))
    assert attempts == 10 + retries
    if budget == 1.0:
        assert (exhausted, retries) == (0, 20)
    else:  # two, unless the first answers came a second apart (the retries' own time)
        assert exhausted >= 6 and retries <= 2 * (10 - exhausted)


@LISTENERS
async def test_backend_dying_mid_stream_ends_with_error_event_and_no_retry(listener: str) -> None:
    dying = script(lambda r: sse_reply(["a", "b", "c", "d"], die_after=2))
    async with TinyUpstream(dying) as a, TinyUpstream(dying) as b:
        config = fast_config([a.url, b.url])
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            events = [e for e in response.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2][len(b"data: ") :])
            assert error["error"]["code"] == "bad_gateway"
            assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
            assert in_flight(edge) == [0, 0]
            failures = [b.failures for b in edge.wiring.registry.backends]
            assert {"protocol": 1} in failures
    assert len(inference(a)) + len(inference(b)) == 1  # no retry after the first byte


@LISTENERS
@pytest.mark.parametrize("how", ["dies", "stalls"])
async def test_a_stream_cut_inside_an_event_ends_with_whole_events_only(
    listener: str, how: str
) -> None:
    """The half event the backend sent before it died, or stalled past the chunk timeout, is
    held back: the edge glued its error event to it, which SDKs fail to parse (the OpenAI SDK
    raised JSONDecodeError instead of APIError)."""
    whole = sse_reply(["a"]).chunks[0]
    half = b'data: {"choices": [{"index": 0, "te'
    if how == "dies":
        reply = Reply(headers=[("content-type", "text/event-stream")],
                      chunks=[whole, half, b"never"], die_after=2)  # fmt: skip
    else:
        reply = Reply(headers=[("content-type", "text/event-stream")],
                      chunks=[whole, half, b"late"], delays=[0, 0, 5.0])  # fmt: skip
    async with TinyUpstream(script(lambda r: reply)) as up:
        config = fast_config([up.url], chunk_timeout=0.8)
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            assert response.content.endswith(b"\n\ndata: [DONE]\n\n")
            events = [e for e in response.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            datas = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
            assert datas[0]["choices"][0]["text"] == "a"
            assert datas[-1]["error"]["code"] in ("bad_gateway", "upstream_timeout")
            assert len(datas) == 2
            assert in_flight(edge) == [0]


async def test_a_stream_whose_last_event_lacks_its_blank_line_is_passed_whole() -> None:
    """What the edge holds of an unfinished event goes out when the stream ends."""
    chunks = [*sse_reply(["a"]).chunks[:1], b'data: {"choices": [{"index": 0, "text": "b"}]}']
    reply = Reply(headers=[("content-type", "text/event-stream")], chunks=chunks)
    async with TinyUpstream(script(lambda r: reply)) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            assert response.content == b"".join(chunks)


async def test_connect_refused_is_retried_elsewhere() -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as good:
        dead = TinyUpstream(script(lambda r: sse_reply(["never"])))
        async with dead:
            dead_url = dead.url
        config = fast_config([dead_url, good.url], pool_warm_connections=0)
        async with run_edge(config, start=False) as edge, client(edge) as http:
            for _ in range(2):  # round robin reaches the dead one in two tries
                response = await http.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200
            assert edge.wiring.registry.backends[0].failures["connect"] >= 1
            assert in_flight(edge) == [0, 0]
    assert len(inference(good)) == 2


async def test_first_byte_timeout_is_504_and_aborts() -> None:
    never = asyncio.Event()  # the head never comes: the timeout is the only way out

    async def silent(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        await never.wait()
        return sse_reply(["late"])

    async with TinyUpstream(silent) as up:
        config = fast_config([up.url], first_byte_timeout=0.3)
        async with run_edge(config) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 504
            assert response.json()["error"]["code"] == "upstream_timeout"
            assert in_flight(edge) == [0]
            await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
    aborts = [json.loads(r.body) for r in up.requests if r.path == "/abort_request"]
    assert aborts == [{"rid": response.headers["x-request-id"]}]


@LISTENERS
async def test_chunk_timeout_ends_the_stream_with_504_event(listener: str) -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["a", "b"], delay=1.0))) as up:
        config = fast_config([up.url], chunk_timeout=0.3)
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            events = [e for e in response.content.split(b"\n\n") if e]
            assert json.loads(events[-2][6:])["error"]["code"] == "upstream_timeout"
            assert events[-1] == b"data: [DONE]"
            assert in_flight(edge) == [0]


@LISTENERS
async def test_a_steady_stream_longer_than_the_chunk_timeout_completes(listener: str) -> None:
    """The timeout is between chunks, not for the whole body: each chunk is progress, also
    when the listener's body writer passes chunks on without waking the request's task."""
    words = [f"w{i}" for i in range(10)]  # 2 s in all, twice the timeout
    async with TinyUpstream(script(lambda r: sse_reply(words, delay=0.2))) as up:
        # 0.8 s to spare per gap: a stall on a busy machine does not fire the timeout
        config = fast_config([up.url], chunk_timeout=1.0)
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            events = [e for e in response.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == words
            assert in_flight(edge) == [0]


class _FaultyPolicy(RoundRobin):
    """A routing policy with a bug: the edge's own fault, mid-request."""

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        raise KeyError("a bug")


@LISTENERS
async def test_a_fault_of_the_edge_is_a_500_in_openai_shape_and_the_connection_goes_on(
    listener: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["ok"]))) as up:
        async with run_edge(fast_config([up.url]), listener=listener) as edge, client(edge) as http:
            app = edge.wiring.app
            working, app.policy = app.policy, _FaultyPolicy()
            response = await http.post("/v1/completions", json={**COMPLETION, "rid": "bug-1"})
            assert response.status_code == 500
            assert response.json()["error"]["code"] == "internal_error"
            assert response.headers["x-request-id"] == "bug-1"
            assert "request bug-1 (POST '/v1/completions') failed" in caplog.text
            assert "KeyError: 'a bug'" in caplog.text  # the traceback is logged
            metrics = (await http.get(edge.admin_url + "/metrics")).text
            assert 'route="/v1/completions",status="500"' in metrics
            assert in_flight(edge) == [0]
            app.policy = working
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "headers", "content", "status", "code"),
    [
        ("POST", "/v1/completions", {"content-type": "application/json"}, b"{nope", 400,
         "invalid_json"),
        ("POST", "/v1/completions", {"content-type": "application/json"}, b"[]", 400,
         "invalid_json"),
        ("POST", "/v1/completions", {"content-type": "text/plain"}, b"{}", 415,
         "unsupported_media_type"),
        ("POST", "/v1/completions", {"content-type": "application/json"},
         b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "payload_too_large"),
        ("POST", "/v1/chat/completions", {"content-type": "application/json"}, b"{}", 400,
         "missing_field"),
        ("POST", "/v1/chat/completions", {"content-type": "application/json"},
         b'{"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}', 404,
         "model_not_found"),
        ("POST", "/v1/nothing", {"content-type": "application/json"}, b"{}", 404, "not_found"),
        ("GET", "/v1/completions", {}, b"", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", {}, b"", 405, "method_not_allowed"),
        ("GET", "/v1/models/gpt-17", {}, b"", 404, "model_not_found"),
        ("POST", "/v1/completions", {"content-type": "application/json", "x-request-id": "a b"},
         b'{"prompt": "x"}', 400, "invalid_request_id"),
    ],
)  # fmt: skip
async def test_bad_input_gets_openai_error_before_any_backend_is_touched(
    method: str, path: str, headers: dict[str, str], content: bytes, status: int, code: str
) -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        async with run_edge(fast_config([up.url], max_body_bytes=4096)) as edge:
            async with client(edge) as http:
                response = await http.request(method, path, headers=headers, content=content)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    if status == 405:
        assert "allow" in response.headers
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])  # a new one
    assert inference(up) == []


@pytest.mark.parametrize(
    ("path", "content", "code"),
    [("/v1/completions", b"[]", "invalid_json"), ("/v1/chat/completions", b"{}", "missing_field")],
)
async def test_an_error_on_an_inference_route_carries_the_clients_request_id(
    path: str, content: bytes, code: str
) -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            headers = {"content-type": "application/json", "x-request-id": "req-7"}
            response = await http.post(path, headers=headers, content=content)
    assert response.json()["error"]["code"] == code
    assert response.headers["x-request-id"] == "req-7"


async def test_body_over_limit_without_content_length_is_413() -> None:
    """A chunked body is counted as it arrives: 413 once past the limit, before it ends."""
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        async with run_edge(fast_config([up.url], max_body_bytes=1000)) as edge:
            port = int(edge.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\n"
                b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for _ in range(3):  # 1500 bytes, and the body never ends
                writer.write(b"1f4\r\n" + b"x" * 500 + b"\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert inference(up) == []


async def test_a_refused_body_is_freed_with_its_answer_not_by_the_collector() -> None:
    """The error kept for the answer held its traceback, and through it the request's frames
    and the body's chunks, in a reference cycle: under the edge's rare collections a flood of
    413s held up to `max_body_bytes` each."""
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        async with run_edge(fast_config([up.url], max_body_bytes=100_000)) as edge:
            port = int(edge.url.rsplit(":", 1)[1])
            gc.collect()
            gc.disable()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\n"
                    b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                    + (b"2710\r\n" + b" " * 10_000 + b"\r\n")
                    * 11
                )
                assert (await read_response(reader))[0] == 413
                writer.close()
                # Freed once the request's task ends (with the collector off, never if in a cycle).
                await wait_until(
                    lambda: (
                        not any(
                            isinstance(o, PayloadTooLarge) and "100000" in o.message
                            for o in gc.get_objects()
                        )
                    ),
                    timeout=5,
                )
            finally:
                gc.enable()


async def test_a_stream_its_backend_broke_off_is_freed_with_its_answer() -> None:
    """The backend's error, kept for the accounting, held the relay (and the upstream
    response's buffers) in a reference cycle through its traceback."""
    died = script(lambda r: sse_reply(["a", "b", "c"], die_after=1))
    async with TinyUpstream(died) as up, run_edge(fast_config([up.url])) as edge:
        async with client(edge) as http:
            gc.collect()
            gc.disable()
            try:
                answer = await http.post("/v1/completions", json={**COMPLETION, "stream": True})
                assert answer.status_code == 200 and b'"error"' in answer.content
                # Freed once the request's task ends (with the collector off, never if in a cycle).
                await wait_until(
                    lambda: not any(isinstance(o, StreamRelay) for o in gc.get_objects()),
                    timeout=5,
                )
            finally:
                gc.enable()


async def test_bodies_still_arriving_past_the_budget_are_refused_until_it_frees() -> None:
    """With 300 kB for bodies still arriving: one client's 250 kB that never ends holds most
    of it, and another body in pieces is refused with 503 `overloaded` and retry-after;
    requests whose body comes whole are served meanwhile, and once the first client leaves
    a body in pieces is served again."""
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        config = fast_config([up.url], max_body_bytes=250_000, max_pending_body_bytes=300_000)
        async with run_edge(config) as edge, client(edge) as http:
            budget = edge.wiring.app.body_budget
            assert budget is not None
            port = int(edge.url.rsplit(":", 1)[1])
            head = (
                b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\n"
                b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            piece = b"2710\r\n" + b" " * 10_000 + b"\r\n"  # 10 kB of JSON whitespace
            _, holder = await asyncio.open_connection("127.0.0.1", port)
            holder.write(head + piece * 25)
            await wait_until(lambda: budget.held == 250_000)
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert "quicedge_pending_request_body_bytes 250000.0" in metrics
            assert "quicedge_pending_request_body_bytes_limit 300000.0" in metrics

            async def in_pieces() -> tuple[int, dict[str, str], bytes]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                prompt = json.dumps(COMPLETION).encode()
                writer.write(head + piece * 10 + b"%x\r\n%s\r\n0\r\n\r\n" % (len(prompt), prompt))
                try:
                    return await read_response(reader)
                finally:
                    writer.close()

            status, headers, body = await in_pieces()
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "overloaded"
            assert budget.held == 250_000  # the refused body gave back what it held
            whole = await http.post("/v1/completions", json=COMPLETION)
            assert whole.status_code == 200
            holder.close()
            await wait_until(lambda: budget.held == 0)
            status, _, body = await in_pieces()
            assert status == 200 and b"[DONE]" in body


async def test_non_streamed_answers_share_a_budget_and_one_past_it_is_refused() -> None:
    """With 300 kB for non-streamed answers: one of 250 kB that its backend holds at all but
    its end holds that much; another of 100 kB is refused with 503 `overloaded` and
    retry-after, while a small one is served; once the first is
    passed on nothing stays counted, and a large one is served again."""
    release = asyncio.Event()

    def answer(size: int, hold: asyncio.Event | None = None) -> Reply:
        text = json.dumps({"choices": [{"index": 0, "text": "x" * size}]}).encode()
        return Reply(chunks=[text[:-1], text[-1:]], chunked=False, hold=hold,
                     headers=[("content-type", "application/json")])  # fmt: skip

    def answer_for(recorded: Recorded) -> Reply:
        size = int(json.loads(recorded.body)["prompt"])  # the answer's size
        return answer(size, release if size == 250_000 else None)

    async with TinyUpstream(script(answer_for)) as up:
        async with run_edge(fast_config([up.url], max_pending_answer_bytes=300_000)) as edge:
            budget = edge.wiring.app.answer_budget
            assert budget is not None
            async with client(edge) as http:

                def completion(size: int) -> Any:
                    body = {**COMPLETION, "prompt": str(size), "stream": False}
                    return http.post("/v1/completions", json=body)

                held = asyncio.ensure_future(completion(250_000))
                await wait_until(lambda: budget.held > 250_000)
                async with httpx.AsyncClient() as admin:
                    metrics = (await admin.get(edge.admin_url + "/metrics")).text
                assert "quicedge_pending_answer_bytes_limit 300000.0" in metrics
                refused = await completion(100_000)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "overloaded"
                assert "non-streamed answers hold" in refused.json()["error"]["message"]
                assert (await completion(10)).status_code == 200
                release.set()
                assert (await held).status_code == 200
                assert budget.held == 0
                assert (await completion(100_000)).status_code == 200
                assert budget.held == 0


async def test_a_backend_whose_load_polls_fail_keeps_its_last_load_and_is_counted() -> None:
    """An overloaded server's /v1/loads may hang: the edge forgot its load at the first failed
    poll, which cleared its degradation and sent it traffic again."""
    hang = asyncio.Event()
    never = asyncio.Event()

    async def loads(recorded: Recorded) -> Reply:
        if recorded.path in ("/v1/loads", "/get_load"):
            if hang.is_set():
                await never.wait()
            rank = {"num_running_reqs": 9, "num_waiting_reqs": 40, "token_usage": 0.99}
            return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                         headers=[("content-type", "application/json")])  # fmt: skip
        return health_ok(recorded) or sse_reply(["x"])

    async with TinyUpstream(loads) as up:
        config = fast_config([up.url], loads_interval=0.1, health_timeout=0.2)
        async with run_edge(config) as edge:
            backend = edge.wiring.registry.backends[0]
            await wait_until(lambda: backend.degraded)
            hang.set()
            await wait_until(lambda: backend.load_polls_failing >= 3)
            assert backend.degraded and backend.load.token_usage == 0.99
            metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
            name = "quicedge_backend_load_poll_failures_total"
            assert sample(metrics, f'{name}{{backend="{backend.name}"}}') >= 3
            never.set()


async def test_no_healthy_backend_is_503() -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["x"]))) as up:
        async with run_edge(fast_config([up.url]), start=False) as edge, client(edge) as http:
            edge.wiring.registry.backends[0].healthy = False
            response = await http.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "no_healthy_backend"
            ready = await httpx.AsyncClient().get(edge.admin_url + "/ready")
            assert ready.status_code == 503
    assert inference(up) == []


async def test_repeated_5xx_ejects_the_backend_passively() -> None:
    failing = script(lambda r: Reply(status=500, chunks=[b'{"error":"boom"}'], chunked=False))
    async with (
        TinyUpstream(failing) as bad,
        TinyUpstream(script(lambda r: sse_reply(["x"]))) as good,
    ):
        config = fast_config([bad.url, good.url], eject_after_failures=2, eject_base=30.0)
        async with run_edge(config) as edge, client(edge) as http:
            statuses = [
                (await http.post("/v1/completions", json=COMPLETION)).status_code for _ in range(4)
            ]
            assert statuses.count(500) == 2  # relayed as the backend said: 500 is not retried
            bad_backend = edge.wiring.registry.backends[0]
            assert bad_backend.ejected_until > 0
            for _ in range(4):
                response = await http.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 200
            assert in_flight(edge) == [0, 0]
    assert len(inference(bad)) == 2


@LISTENERS
async def test_a_client_that_stops_reading_slows_the_upstream_instead_of_filling_memory(
    listener: str,
) -> None:
    event = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    total = 800 * len(event)  # 50 MiB: far more than every socket buffer on the way holds

    def flood(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        return Reply(headers=[("content-type", "text/event-stream")], chunks=[event] * 800)

    async with TinyUpstream(flood) as up:
        config = fast_config([up.url], chunk_timeout=30.0)
        async with run_edge(config, listener=listener) as edge:
            port = int(edge.url.rsplit(":", 1)[1])
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = json.dumps(COMPLETION).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            await writer.drain()
            # Not reading: the upstream's sends start, then stop where the buffers are full. A
            # relay without backpressure would let them run on to the whole answer instead.
            stalled_at = await settled(lambda: up.body_bytes_sent.get("/v1/completions", 0))
            assert 0 < stalled_at < total // 2, stalled_at  # started, then held back
            writer.close()  # and now the client leaves: the upstream stream is aborted
            await wait_until(
                lambda: in_flight(edge) == [0] and up.replies_cut == ["/v1/completions"]
            )
            assert up.body_bytes_sent["/v1/completions"] < total
            assert in_flight(edge) == [0]


async def test_backends_at_their_cap_answer_503_at_capacity() -> None:
    release = asyncio.Event()

    async with TinyUpstream(held_sse(release, ["done"])) as up:
        config = fast_config([up.url], max_concurrency_per_backend=1)
        async with run_edge(config) as edge, client(edge) as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=COMPLETION))
            await wait_until(lambda: in_flight(edge) == [1])
            second = await http.post("/v1/completions", json=COMPLETION)
            assert second.status_code == 503
            assert second.json()["error"]["code"] == "at_capacity"
            release.set()
            assert (await first).status_code == 200
            assert in_flight(edge) == [0]


class CountingPolicy:
    """Wraps the real policy and counts its calls (routing itself is unchanged)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.chosen = 0
        self.outcomes: list[Any] = []

    def choose(self, view: Any, candidates: Any) -> Any:
        self.chosen += 1
        return self.inner.choose(view, candidates)

    def observe(self, outcome: Any) -> None:
        self.outcomes.append(outcome)
        self.inner.observe(outcome)


async def test_every_attempt_is_observed_exactly_once() -> None:
    replies = iter(
        [
            Reply(status=503, chunks=[b"{}"], chunked=False),  # retried elsewhere
            sse_reply(["o", "k"]),
            sse_reply(["a", "b", "c"], die_after=1),  # dies mid-stream
            Reply(status=400, chunks=[b'{"error":{"message":"bad"}}'], chunked=False),
            sse_reply(["fine"]),
        ]
    )
    async with TinyUpstream(script(lambda r: next(replies))) as up:
        config = fast_config([up.url], max_retries=1)
        async with run_edge(config) as edge, client(edge) as http:
            counting = CountingPolicy(edge.wiring.app.policy)  # type: ignore[attr-defined]
            edge.wiring.app.policy = counting  # type: ignore[attr-defined]
            statuses = [
                (await http.post("/v1/completions", json=COMPLETION)).status_code for _ in range(4)
            ]
            assert in_flight(edge) == [0]
    # one backend: the 503 is relayed (nothing else to try), then ok, mid-stream death, 400
    assert statuses == [503, 200, 200, 400]
    assert counting.chosen == len(counting.outcomes) == 4
    assert [o.error for o in counting.outcomes] == ["5xx", None, "protocol", "4xx"]
    # the streamed answer reaches the policy, so its prefix tree learns what the backend cached
    assert counting.outcomes[1].completion_text == "ok"
    assert len(inference(up)) == 4


async def test_a_retried_request_is_observed_once_per_backend_tried() -> None:
    busy = script(lambda r: Reply(status=503, chunks=[b"{}"], chunked=False))
    async with TinyUpstream(busy) as bad, TinyUpstream(script(lambda r: sse_reply(["x"]))) as good:
        config = fast_config([bad.url, good.url], eject_after_failures=100)
        async with run_edge(config) as edge, client(edge) as http:
            counting = CountingPolicy(edge.wiring.app.policy)  # type: ignore[attr-defined]
            edge.wiring.app.policy = counting  # type: ignore[attr-defined]
            for _ in range(6):
                assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
    attempts = len(inference(bad)) + len(inference(good))
    assert len(inference(good)) == 6 and len(inference(bad)) >= 1
    assert counting.chosen == len(counting.outcomes) == attempts
    assert sum(o.error == "5xx" for o in counting.outcomes) == len(inference(bad))


async def test_the_text_of_several_interleaved_choices_is_not_learned_as_one_continuation() -> None:
    async with TinyUpstream(script(lambda r: sse_reply(["x", "y"]))) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            counting = CountingPolicy(edge.wiring.app.policy)  # type: ignore[attr-defined]
            edge.wiring.app.policy = counting  # type: ignore[attr-defined]
            for n in (1, 2):
                answer = await http.post("/v1/completions", json={**COMPLETION, "n": n})
                assert answer.status_code == 200
    assert [o.completion_text for o in counting.outcomes] == ["xy", None]
    assert [o.view.choices for o in counting.outcomes] == [1, 2]
