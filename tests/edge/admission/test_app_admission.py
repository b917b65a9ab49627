"""Admission through the whole app over real sockets: 401 and 429 in OpenAI's shape, tenants in
metrics and spans, the client's Authorization never forwarded, per-tenant concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from backends.sim import SimServer
from edge.admission.settings import (
    AdmissionSettings,
    AnonymousSettings,
    RedisSettings,
    TenantSettings,
)
from edge.admission.tenants import key_digest
from edge.config import ProxyConfig
from edge.stages.validate import COMPLETIONS, GENERATE
from edge.stages.view import build_view
from edge.wiring import build
from tests.edge.conftest import (
    LISTENERS,
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
from tests.edge.test_app_sim import metrics_text, sim_config
from tests.edge.tls_edge import tls_edge
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def tenant(name: str, tier: str, key: str, **limits: Any) -> TenantSettings:
    return TenantSettings(name=name, tier=tier, api_key_sha256=[key_digest(key)], **limits)  # type: ignore[arg-type]


def with_admission(config: ProxyConfig, **values: Any) -> ProxyConfig:
    config.admission = AdmissionSettings(**values)  # the wiring validates it
    return config


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_401_for_unknown_keys_and_for_no_key_when_anonymous_is_off() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            anonymous=AnonymousSettings(enabled=False),
            tenants=[tenant("acme", "gold", "sk-acme")],
        )
        async with run_edge(config) as edge, client(edge) as http:
            for headers in ({}, bearer("sk-wrong"), {"authorization": "Basic eDp5"}):
                r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 401, headers
                error = r.json()["error"]
                assert error["code"] == "invalid_api_key"
                assert error["type"] == "invalid_request_error"
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.headers["x-request-id"]
            ok = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-acme"))
            assert ok.status_code == 200
            text = await metrics_text(edge)
            assert (
                'quicedge_admission_rejections_total{reason="unauthorized",tenant="-"} 3.0' in text
            )
            assert 'quicedge_tenant_requests_total{tenant="acme",tier="gold"} 1.0' in text


@LISTENERS
async def test_429_with_retry_after_once_the_burst_is_spent(listener: str) -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            tenants=[tenant("slow", "bronze", "sk-slow", requests_per_second=0.05, burst=2)],
        )
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            codes, remaining = [], []
            for stream in (False, True, False, False):
                r = await http.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                    headers=bearer("sk-slow"))  # fmt: skip
                codes.append(r.status_code)
                remaining.append(r.headers.get("x-ratelimit-remaining-requests"))
                assert r.headers.get("x-ratelimit-limit-requests") == "2"
            assert codes == [200, 200, 429, 429]
            assert remaining == ["1", "0", "0", "0"]
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert 1 <= int(r.headers["retry-after"]) <= 20  # one request per 20 s refills
            assert 0 < int(r.headers["retry-after-ms"]) <= 20_000
            assert r.headers["x-ratelimit-reset-requests"].startswith("39.")  # 2 at 1 per 20 s
            # the anonymous tenant has no limits by default: it is not held back by `slow`
            anon = await http.post("/v1/chat/completions", json=CHAT)
            assert anon.status_code == 200
            assert not any(k.startswith("x-ratelimit") for k in anon.headers)
            text = await metrics_text(edge)
            assert (
                'quicedge_admission_rejections_total{reason="requests",tenant="slow"} 2.0' in text
            )
            assert 'quicedge_tenant_requests_total{tenant="anonymous",tier="bronze"} 1.0' in text


async def test_tokens_per_minute_counts_prompt_and_completion() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            tenants=[tenant("tok", "silver", "sk-tok", tokens_per_minute=40)],
        )
        body = {**CHAT, "max_tokens": 30, "ignore_eos": True}
        async with run_edge(config) as edge, client(edge) as http:
            first = await http.post("/v1/chat/completions", json=body, headers=bearer("sk-tok"))
            assert first.status_code == 200
            assert first.json()["usage"]["completion_tokens"] == 30
            # prompt (a few tokens) + 30 completion tokens leave less than the next prompt needs
            second = await http.post("/v1/chat/completions", json=body, headers=bearer("sk-tok"))
            assert second.status_code == 429
            assert "tokens per minute" in second.json()["error"]["message"]
            text = await metrics_text(edge)
            assert 'quicedge_tenant_tokens_total{kind="completion",tenant="tok"} 30.0' in text
            assert 'quicedge_admission_rejections_total{reason="tokens",tenant="tok"} 1.0' in text


async def test_tenant_on_the_span_and_authorization_never_forwarded() -> None:
    def answer(recorded: Recorded) -> Reply:
        return health_ok(recorded) or sse_reply(["ok"])

    async with TinyUpstream(answer) as up:
        config = with_admission(
            fast_config([up.url]), tenants=[tenant("acme", "gold", "sk-acme-secret")]
        )
        async with run_edge(config, trace=True) as edge, client(edge) as http:
            body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
            headers = {**bearer("sk-acme-secret"), "x-tenant-id": "someone-else"}
            r = await http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200
            sent = [x for x in up.requests if x.path == "/v1/completions"]
            assert len(sent) == 1
            assert "authorization" not in sent[0].headers
            assert b"sk-acme-secret" not in sent[0].body
            assert edge.spans is not None
            roots = [s for s in edge.spans.get_finished_spans() if s.name == "quicedge.request"]
            assert roots and roots[-1].attributes is not None
            assert roots[-1].attributes["quicedge.tenant"] == "acme"
            assert roots[-1].attributes["quicedge.tier"] == "gold"


async def test_max_concurrent_refuses_the_extra_request_and_frees_its_slot() -> None:
    release = asyncio.Event()

    async with TinyUpstream(held_sse(release)) as up:
        config = with_admission(
            fast_config([up.url]), tenants=[tenant("one", "gold", "sk-one", max_concurrent=1)]
        )
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        async with run_edge(config) as edge, client(edge) as http:
            first = asyncio.ensure_future(
                http.post("/v1/completions", json=body, headers=bearer("sk-one"))
            )
            await wait_until(lambda: any(x.path == "/v1/completions" for x in up.requests))
            second = await http.post("/v1/completions", json=body, headers=bearer("sk-one"))
            assert second.status_code == 429
            assert "in flight" in second.json()["error"]["message"]
            assert second.headers["retry-after"] == "1"
            release.set()
            assert (await first).status_code == 200
            third = await http.post("/v1/completions", json=body, headers=bearer("sk-one"))
            assert third.status_code == 200
            assert json.loads(third.content.split(b"\n\n")[0][6:])["choices"][0]["text"] == "ok"


async def test_the_default_edge_admits_anonymous_requests_as_before() -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with run_edge(fast_config([sim.url])) as edge, client(edge) as http:
            r = await http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-any"))
            assert r.status_code == 401  # a key nobody configured is unknown, not ignored


async def _charged(edge: Any, at_least: float) -> float:
    """The tenant `tok`'s completion tokens, once they reach `at_least` (the debit follows
    the answer's end), or what they are after a bounded wait."""
    charged = 0.0
    for _ in range(200):
        text = await metrics_text(edge)
        found = [
            float(x.split()[-1]) for x in text.splitlines()
            if x.startswith('quicedge_tenant_tokens_total{kind="completion",tenant="tok"}')
        ]  # fmt: skip
        charged = found[0] if found else 0.0
        if charged >= at_least:
            break
        await asyncio.sleep(0.01)
    return charged


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_without_usage_is_charged_the_tokens_the_backend_reported(
    route: str,
) -> None:
    """The edge asks the backend for the usage chunk and keeps it from a client that did not
    ask: the tenant pays for every token, where counting the chunks relayed paid once for
    tokens read together (an instant backend's whole answer in a read or two)."""
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            tenants=[tenant("tok", "silver", "sk-tok", tokens_per_minute=100000)],
        )
        body = {**CHAT, "max_tokens": 40, "ignore_eos": True, "stream": True}
        if route == "/v1/completions":
            body = {"model": body["model"], "prompt": "Say ok", "max_tokens": 40,
                    "ignore_eos": True, "stream": True}  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            r = await http.post(route, json=body, headers=bearer("sk-tok"))
            assert r.status_code == 200
            events = [e for e in r.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert all(c["choices"] for c in chunks)  # no usage chunk: the client asked none
            assert all(c.get("usage") is None for c in chunks)
            assert await _charged(edge, 40) == 40


async def test_a_tenant_over_its_request_rate_is_refused_before_its_body_is_read() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            tenants=[tenant("slow", "bronze", "sk-slow", requests_per_second=0.05, burst=1)],
        )
        async with run_edge(config) as edge, client(edge) as http:
            ok = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-slow"))
            assert ok.status_code == 200
            refused = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-slow"))
            assert refused.status_code == 429
            # from now on the body is not even parsed: broken JSON gets the 429, not a 400
            headers = {**bearer("sk-slow"), "content-type": "application/json"}
            r = await http.post("/v1/chat/completions", content=b"{not json", headers=headers)
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 20
            # another tenant is not affected
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_the_admin_view_lists_tenants_and_one_tenants_buckets(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    async with SimServer(sim_config("b1")) as sim:
        redis = RedisSettings(url=redis_url, prefix=redis_prefix, timeout_ms=2000, slow_ms=2000)
        config = with_admission(
            fast_config([sim.url]),
            tenants=[tenant("slow", "bronze", "sk-slow", requests_per_second=0.05, burst=2,
                            tokens_per_minute=6000, max_concurrent=3)],
            **({"redis": redis} if store == "redis" else {}),
        )  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            codes = [
                (await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-slow")))
                .status_code for _ in range(3)
            ]  # fmt: skip
            assert codes == [200, 200, 429]
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                listed = (await admin.get("/tenants")).json()
                one = await admin.get("/tenants/slow")
                missing = await admin.get("/tenants/nobody")
                refused = await admin.post("/tenants/slow")
        assert listed["store"] == store and listed["queue"] is None
        by_name = {t["name"]: t for t in listed["tenants"]}
        assert set(by_name) == {"slow", "anonymous"}
        slow = by_name["slow"]
        assert (slow["tier"], slow["burst"], slow["tokens_per_minute"]) == ("bronze", 2, 6000)
        assert slow["requests_per_second"] == 0.05 and slow["max_concurrent"] == 3
        assert slow["in_flight"] == 0 and 0 < slow["refused_for_s"] <= 20
        assert one.status_code == 200
        buckets = one.json()["buckets"]
        assert buckets["requests"]["limit"] == 2 and buckets["requests"]["remaining"] == 0
        assert 20 < buckets["requests"]["reset_s"] <= 40  # two requests at one per 20 s
        assert buckets["tokens"]["limit"] == 6000 and buckets["tokens"]["remaining"] < 6000
        assert missing.status_code == 404 and refused.status_code == 405


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_max_concurrent_holds_while_the_bucket_take_awaits(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    """Requests arriving together all reach the concurrency check while the first ones wait on
    Redis for their take: only `max_concurrent` of them may go on."""
    release = asyncio.Event()

    async with TinyUpstream(held_sse(release)) as up:
        redis = RedisSettings(url=redis_url, prefix=redis_prefix, timeout_ms=2000, slow_ms=2000)
        config = with_admission(
            fast_config([up.url]),
            tenants=[tenant("two", "gold", "sk-two", requests_per_second=1000.0, burst=1000,
                            max_concurrent=2)],
            **({"redis": redis} if store == "redis" else {}),
        )  # fmt: skip
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        async with run_edge(config) as edge, client(edge) as http:
            sent = [
                asyncio.ensure_future(
                    http.post("/v1/completions", json=body, headers=bearer("sk-two"))
                )
                for _ in range(8)
            ]
            forwarded = lambda: sum(x.path == "/v1/completions" for x in up.requests)  # noqa: E731
            # every request is either refused or held by the upstream (all 8 held: the bug)
            await wait_until(lambda: forwarded() + sum(s.done() for s in sent) >= 8)
            held = forwarded()
            release.set()
            answers = await asyncio.gather(*sent)
            codes = [r.status_code for r in answers]
            assert held == 2 and sorted(codes) == [200] * 2 + [429] * 6
            refused = next(r for r in answers if r.status_code == 429)
            # a 429 like a quota's: the wait in ms too, and where the tenant's buckets stand
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["retry-after-ms"] == "1000"
            assert refused.headers["x-ratelimit-limit-requests"] == "1000"
            assert 990 <= int(refused.headers["x-ratelimit-remaining-requests"]) <= 1000
            assert "x-ratelimit-reset-requests" in refused.headers
            assert edge.wiring.admission.tenants()["tenants"][0]["in_flight"] == 0


def test_a_batch_of_token_id_prompts_is_charged_for_every_prompt() -> None:
    """Routing goes by the first prompt of a batch; admission charges them all."""
    view = build_view(COMPLETIONS, {"prompt": [[1, 2], [3, 4, 5]]}, None)
    assert (view.text, view.approx_tokens, view.batch_tokens) == ("1 2", 2, 5)
    nested = build_view(GENERATE, {"input_ids": [[1], [[2, 3], [4, 5, 6]]]}, None)
    assert nested.batch_tokens == 6
    for one in ({"prompt": [1, 2, 3]}, {"prompt": "abc"}, {"prompt": ["a", "b"]}):
        assert build_view(COMPLETIONS, one, None).batch_tokens is None


async def test_a_batch_of_token_id_prompts_takes_all_its_tokens_from_the_bucket() -> None:
    def answer(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        body: Any = {"id": "x", "object": "text_completion", "choices": []}
        if recorded.path == "/generate":
            body = [{"text": "a", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}}]
        return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with TinyUpstream(answer) as up:
        config = with_admission(
            fast_config([up.url]),
            tenants=[tenant("c", "bronze", "sk-c", tokens_per_minute=2000),
                     tenant("g", "bronze", "sk-g", tokens_per_minute=2000)],
        )  # fmt: skip
        batch = [[1], [7] * 1500]  # a one-token prompt first: 1501 tokens in all
        async with run_edge(config) as edge, client(edge) as http:
            for route, key, body in (
                ("/v1/completions", "sk-c", {"model": "tiny-model", "prompt": batch}),
                ("/generate", "sk-g", {"input_ids": batch}),
            ):
                first = await http.post(route, json=body, headers=bearer(key))
                assert first.status_code == 200, first.text
                assert first.headers["x-ratelimit-remaining-tokens"] == "499"  # 2000 - 1501
                second = await http.post(route, json=body, headers=bearer(key))
                assert second.status_code == 429, route
                assert "tokens per minute" in second.json()["error"]["message"]


# What a client sends: header lines in order; what it gets: (status, body, www-authenticate).
Send = Callable[[list[tuple[str, str]]], Awaitable[tuple[int, dict[str, Any], str | None]]]


@contextlib.asynccontextmanager
async def chat_sender(config: ProxyConfig, transport: str, certs: Any) -> AsyncIterator[Send]:
    """POST /v1/chat/completions to the edge with raw header lines, over `transport`: h1
    (hypercorn), h1-own (our listener), h2 (the TLS listener) or h3 (the QUIC listener)."""
    if transport in ("h1", "h1-own", "h2"):
        async with contextlib.AsyncExitStack() as stack:
            if transport == "h2":
                tls = await stack.enter_async_context(tls_edge(config, certs))
                http = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=tls.url, http2=True, verify=tls.ssl_context)
                )
            else:
                listener = "h1" if transport == "h1-own" else "hypercorn"
                edge = await stack.enter_async_context(run_edge(config, listener=listener))
                http = await stack.enter_async_context(client(edge))

            async def send(
                headers: list[tuple[str, str]],
            ) -> tuple[int, dict[str, Any], str | None]:
                r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.http_version == ("HTTP/2" if transport == "h2" else "HTTP/1.1")
                return r.status_code, r.json(), r.headers.get("www-authenticate")

            yield send
        return
    wiring = await build(config, registry=CollectorRegistry())
    await wiring.start()
    server = H3Server(
        wiring.app,
        tls=TlsMaterial(CertificateFiles(certs.cert, certs.key)),
        tickets=MemoryTicketStore(),
    )
    await server.start("127.0.0.1", 0)
    try:
        async with h3_connect(server.port, certs.ca_cert) as h3:

            async def send_h3(
                headers: list[tuple[str, str]],
            ) -> tuple[int, dict[str, Any], str | None]:
                r = await h3.fetch(
                    "POST",
                    "/v1/chat/completions",
                    body=json.dumps(CHAT).encode(),
                    headers=[(b"content-type", b"application/json")]
                    + [(n.encode(), v.encode()) for n, v in headers],
                )
                assert r.status is not None
                auth = r.header(b"www-authenticate")
                return r.status, json.loads(r.body), auth.decode() if auth else None

            yield send_h3
    finally:
        await server.aclose()
        await wiring.aclose()


@pytest.mark.parametrize("transport", ["h1", "h1-own", "h2", "h3"])
async def test_ambiguous_credentials_are_refused_on_every_transport(
    transport: str, dev_certs: Any
) -> None:
    """`Authorization` is a singleton field (RFC 9110 §11.6.2): two of them, a list of keys in
    one, an empty one or another scheme than Bearer is 401 `invalid_api_key`, never the tenant
    of whichever line came last. `api-key` and `x-api-key` are not read: no key was given."""
    async with SimServer(sim_config("b1")) as sim:
        config = with_admission(
            fast_config([sim.url]),
            anonymous=AnonymousSettings(enabled=False),
            tenants=[tenant("acme", "gold", "sk-acme")],
        )
        async with chat_sender(config, transport, dev_certs) as send:
            status, _, _ = await send([("authorization", "Bearer sk-acme")])
            assert status == 200
            refused = {
                "two, the known one last": [
                    ("authorization", "Bearer sk-wrong"),
                    ("authorization", "Bearer sk-acme"),
                ],
                "the same one twice": [("authorization", "Bearer sk-acme")] * 2,
                "a known one and an empty one": [
                    ("authorization", "Bearer sk-acme"),
                    ("authorization", ""),
                ],
                "a list in one line": [("authorization", "Bearer sk-acme, Bearer sk-wrong")],
                "an empty one": [("authorization", "")],
                "another scheme": [("authorization", "Basic c2stYWNtZTo=")],
                "x-api-key": [("x-api-key", "sk-acme")],
                "api-key": [("api-key", "sk-acme")],
            }
            for case, headers in refused.items():
                status, body, challenge = await send(headers)
                assert status == 401, case
                assert body["error"]["code"] == "invalid_api_key", case
                assert body["error"]["type"] == "invalid_request_error", case
                assert challenge == "Bearer", case
                if case in ("two, the known one last", "the same one twice", "a list in one line"):
                    assert "one API key" in body["error"]["message"], case


async def test_a_request_for_several_answers_is_charged_every_answer() -> None:
    """Nothing is reserved at admission: `n` > 1 is charged what the backend reports, which
    for SGLang is every choice's tokens (chat `usage`), or every output's (`/generate` with
    `sampling_params.n`, a list of outputs)."""

    def answer(recorded: Recorded) -> Reply:
        ok = health_ok(recorded)
        if ok is not None:
            return ok
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        body: Any = {
            "id": "c",
            "object": "chat.completion",
            "choices": [choice, {**choice, "index": 1}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43},
        }
        if recorded.path == "/generate":
            body = [
                {
                    "text": "x",
                    "meta_info": {"id": f"g_{i}", "prompt_tokens": 3, "completion_tokens": 20},
                }
                for i in range(2)
            ]
        return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with TinyUpstream(answer) as up:
        config = with_admission(
            fast_config([up.url]),
            tenants=[tenant("tok", "silver", "sk-tok", tokens_per_minute=1000)],
        )
        async with run_edge(config) as edge, client(edge) as http:
            chat = await http.post("/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 20},
                                   headers=bearer("sk-tok"))  # fmt: skip
            assert chat.status_code == 200
            text = await metrics_text(edge)
            assert 'quicedge_tenant_tokens_total{kind="completion",tenant="tok"} 40.0' in text
            generate = await http.post("/generate", headers=bearer("sk-tok"), json={
                "text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 20}})  # fmt: skip
            assert generate.status_code == 200
            text = await metrics_text(edge)
            assert 'quicedge_tenant_tokens_total{kind="completion",tenant="tok"} 80.0' in text
