"""CORS over real sockets: a preflight shaped as Chromium sends it, answered by the edge (HTTP/2
on the TLS listener), and the CORS headers on answers, streamed ones included, on both
listeners (hypercorn's send and our HTTP/1.1 listener's body writer)."""

from __future__ import annotations

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from certs.dev import DevCertificates
from edge.cors import CorsConfig
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.tls_edge import tls_edge
from transport.h1_server import H1Listener

PAGE = "http://localhost:8080"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# The headers Chromium 13x sends on the preflight of `fetch(url, {method: "POST", headers:
# {"Authorization": ..., "Content-Type": "application/json"}})` from another origin.
PREFLIGHT = {
    "accept": "*/*",
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization,content-type",
    "origin": PAGE,
    "sec-fetch-mode": "cors",
    "sec-fetch-site": "cross-site",
    "sec-fetch-dest": "empty",
    "referer": PAGE + "/",
    "user-agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "HeadlessChrome/131.0.0.0 Safari/537.36",
    "accept-encoding": "gzip, deflate, br, zstd",
    "accept-language": "en-US",
}


def stand_in() -> SimServer:
    return SimServer(SimConfig(name="c", port=0, profile="instant"))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/generate",
                                  "/v1/models"])  # fmt: skip
async def test_a_browser_preflight_is_answered_by_the_edge(
    dev_certs: DevCertificates, path: str
) -> None:
    cors = CorsConfig(origins=[PAGE], max_age=300)
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        assert sim.api is not None
        before = sim.api.requests.copy()
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            r = await http.options(edge.url + path, headers=PREFLIGHT)
        reached = sim.api.requests - before
    assert r.http_version == "HTTP/2"
    assert r.status_code == 204
    assert r.content == b""
    h = r.headers
    assert h["access-control-allow-origin"] == PAGE
    expected = {"/generate": "POST, PUT", "/v1/models": "GET"}.get(path, "POST")
    assert h["access-control-allow-methods"] == expected
    assert h["access-control-allow-headers"] == "authorization, content-type"
    assert h["access-control-max-age"] == "300"
    assert "Origin" in h["vary"]
    assert "access-control-allow-credentials" not in h
    assert reached[path] == 0  # answered by the edge, not a backend


async def test_other_origins_and_paths(dev_certs: DevCertificates) -> None:
    cors = CorsConfig(origins=[PAGE])
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            evil = await http.options(
                edge.url + "/v1/chat/completions",
                headers={**PREFLIGHT, "origin": "https://evil.test"},
            )
            unknown = await http.options(edge.url + "/v1/nothing", headers=PREFLIGHT)
            plain = await http.post(edge.url + "/v1/chat/completions", json=CHAT)
            foreign = await http.post(
                edge.url + "/v1/chat/completions",
                json=CHAT,
                headers={"origin": "https://evil.test"},
            )
    assert evil.status_code == 403
    assert evil.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in evil.headers
    assert unknown.status_code == 404 and unknown.json()["error"]["type"]
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


async def test_cors_is_off_by_default(dev_certs: DevCertificates) -> None:
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            r = await http.options(edge.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405
    assert "access-control-allow-origin" not in r.headers


def _check_response_headers(r: httpx.Response) -> None:
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["timing-allow-origin"] == PAGE
    exposed = r.headers["access-control-expose-headers"].split(", ")
    assert "x-request-id" in exposed
    assert "Origin" in r.headers["vary"]


async def test_answers_carry_cors_headers_on_h2_streams(dev_certs: DevCertificates) -> None:
    cors = CorsConfig(origins=[PAGE])
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            headers = {"origin": PAGE}
            whole = await http.post(edge.url + "/v1/chat/completions", json=CHAT, headers=headers)
            stream = {**CHAT, "stream": True}
            url = edge.url + "/v1/chat/completions"
            async with http.stream("POST", url, json=stream, headers=headers) as streamed:
                body = b"".join([c async for c in streamed.aiter_bytes()])
            error = await http.post(edge.url + "/v1/chat/completions", json={}, headers=headers)
    for r in (whole, streamed, error):
        _check_response_headers(r)
    assert b"[DONE]" in body
    assert error.status_code == 400


async def test_answers_carry_cors_headers_through_the_body_writer() -> None:
    """Our own HTTP/1.1 listener sends the head from the upstream read callback."""
    from prometheus_client import CollectorRegistry

    from edge.wiring import build

    cors = CorsConfig(origins=["*"])
    async with stand_in() as sim:
        wiring = await build(fast_config([sim.url]), registry=CollectorRegistry(), cors=cors)
        await wiring.start()
        listener = H1Listener(wiring.app, host="127.0.0.1", port=0)
        await listener.start()
        try:
            async with httpx.AsyncClient(base_url=listener.url) as http:
                async with http.stream("POST", "/v1/chat/completions",
                                       json={**CHAT, "stream": True},
                                       headers={"origin": PAGE}) as r:  # fmt: skip
                    body = b"".join([c async for c in r.aiter_bytes()])
        finally:
            await listener.stop()
            await wiring.aclose()
    assert r.headers["access-control-allow-origin"] == "*"
    assert r.headers["timing-allow-origin"] == "*"
    assert b"[DONE]" in body


def test_settings_are_checked() -> None:
    CorsConfig(origins=[PAGE, "https://a.example:8443"]).validate()
    for bad, message in [
        (CorsConfig(origins=["localhost:8080"]), "cors.origins"),
        (CorsConfig(origins=[PAGE + "/"]), "cors.origins"),
        (CorsConfig(origins=["*"], allow_credentials=True), "cors.allow_credentials"),
        (CorsConfig(origins=[PAGE], max_age=-1), "cors.max_age"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad.validate()


async def test_the_openai_js_sdks_preflight_from_firefox_is_allowed_by_default(
    dev_certs: DevCertificates,
) -> None:
    """openai-node sets `User-Agent` and its `x-stainless-*` headers on every call; Firefox
    and Safari send a page-set `User-Agent` and ask for it in the preflight (Chromium drops
    it). With the default `[cors] headers`, all of them must be allowed, or the browser
    refuses the call."""
    asked = (
        "authorization,content-type,user-agent,x-stainless-arch,x-stainless-lang,"
        "x-stainless-os,x-stainless-package-version,x-stainless-retry-count,"
        "x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout"
    )
    firefox = {**PREFLIGHT, "access-control-request-headers": asked}
    cors = CorsConfig(origins=[PAGE])
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            r = await http.options(edge.url + "/v1/chat/completions", headers=firefox)
    assert r.status_code == 204
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert set(asked.split(",")) <= allowed


async def test_a_page_may_read_whether_to_retry(dev_certs: DevCertificates) -> None:
    """openai-node reads `x-should-retry` before retrying a 5xx; a page's script sees only the
    headers the answer exposes, so the edge exposes it with the retry-after ones."""
    cors = CorsConfig(origins=[PAGE])
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            via = ", ".join(f"1.1 quicedge-{i}" for i in range(8))
            r = await http.post(edge.url + "/v1/chat/completions", json=CHAT,
                                headers={"origin": PAGE, "via": via})  # fmt: skip
    assert r.status_code == 508 and r.headers["x-should-retry"] == "false"
    exposed = r.headers["access-control-expose-headers"].split(", ")
    assert {"x-should-retry", "retry-after", "retry-after-ms"} <= set(exposed)


@pytest.mark.parametrize("listener", ["h1", "h1-tls", "h2"])
async def test_a_preflights_204_carries_no_length_or_chunking(
    dev_certs: DevCertificates, listener: str
) -> None:
    """RFC 9110 §8.6: a server must not send Content-Length in a 204; nor may a 204 be
    chunked (RFC 9112 §6.1), which would leave a strict client reading a body that never ends."""
    cors = CorsConfig(origins=[PAGE])
    async with stand_in() as sim:
        config = fast_config([sim.url])
        if listener == "h1":
            async with run_edge(config, cors=cors) as edge, client(edge) as http:
                r = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        else:
            async with tls_edge(config, dev_certs, cors=cors) as edge:
                h2 = listener == "h2"
                async with httpx.AsyncClient(http2=h2, verify=edge.ssl_context) as http:
                    r = await http.options(edge.url + "/v1/chat/completions", headers=PREFLIGHT)
                assert r.http_version == ("HTTP/2" if h2 else "HTTP/1.1")
    assert r.status_code == 204 and r.content == b""
    assert "content-length" not in r.headers
    assert "transfer-encoding" not in r.headers
