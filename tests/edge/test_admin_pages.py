"""The admin port refuses what a web page makes a browser send (a cross-site form POST to
`127.0.0.1:9901`, a DNS-rebinding page's reads), with or without the admin token, and still
answers curl, scrapers and an operator who types the URL. Served, as `quicedge serve` serves the
admin port, on our own HTTP/1.1 listener."""

from __future__ import annotations

import httpx

from edge.admin import guard_actions
from tests.edge.conftest import TinyUpstream, fast_config, h1_app, health_ok, run_edge

FORM = {"content-type": "application/x-www-form-urlencoded"}
"""A "simple" request: a browser sends it cross-site without a CORS preflight."""
CROSS_SITE_FORM = {**FORM, "origin": "https://pages.example", "sec-fetch-site": "cross-site",
                   "sec-fetch-mode": "navigate"}  # fmt: skip
REBOUND_FETCH = {"sec-fetch-site": "same-origin", "sec-fetch-mode": "cors",
                 "host": "rebound.example:9901"}  # fmt: skip
TYPED_URL = {"sec-fetch-site": "none", "sec-fetch-mode": "navigate"}


async def test_a_web_page_cannot_drain_or_read_without_a_token() -> None:
    async with TinyUpstream(health_ok) as up, run_edge(fast_config([up.url])) as edge:
        name = up.url.removeprefix("http://")
        (backend,) = edge.wiring.registry.backends
        async with (
            h1_app(guard_actions(edge.wiring.admin_app, None)) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            page = await http.post(f"/backends/{name}/drain", content=b"x=1",
                                   headers=CROSS_SITE_FORM)  # fmt: skip
            assert page.status_code == 403, page.text
            assert page.json()["error"]["code"] == "browser_request"
            assert not backend.held
            # A page's script on the same site (Origin, no Sec-Fetch: an older browser).
            origin_only = await http.post("/config/reload", headers={"origin": "http://x"})
            assert origin_only.status_code == 403
            rebound = await http.get("/tenants", headers=REBOUND_FETCH)
            assert rebound.status_code == 403
            # curl, a scraper, an operator's browser on a typed URL: answered as before.
            assert (await http.get("/backends", headers=TYPED_URL)).status_code == 200
            assert (await http.get("/metrics")).status_code == 200
            curl = await http.post(f"/backends/{name}/drain")
            assert curl.status_code == 200, curl.text
            assert backend.held


async def test_a_web_page_is_refused_before_the_token_is_asked() -> None:
    async with TinyUpstream(health_ok) as up, run_edge(fast_config([up.url])) as edge:
        name = up.url.removeprefix("http://")
        async with (
            h1_app(guard_actions(edge.wiring.admin_app, b"s3cret")) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            page = await http.post(f"/backends/{name}/drain", headers=CROSS_SITE_FORM)
            assert page.status_code == 403
            bare = await http.post(f"/backends/{name}/drain")
            assert bare.status_code == 401
            ok = await http.post(
                f"/backends/{name}/drain", headers={"authorization": "Bearer s3cret"}
            )
            assert ok.status_code == 200, ok.text


async def test_the_admin_token_must_come_alone() -> None:
    """Two `Authorization` headers are refused, as a tenant's are: which one counts would be the
    listener's choice (the first, the last, or both joined), not the caller's."""
    async with TinyUpstream(health_ok) as up, run_edge(fast_config([up.url])) as edge:
        name = up.url.removeprefix("http://")
        (backend,) = edge.wiring.registry.backends
        async with h1_app(guard_actions(edge.wiring.admin_app, b"s3cret")) as admin:
            for second in ("Bearer wrong", "Bearer s3cret"):
                headers = [("authorization", "Bearer s3cret"), ("authorization", second)]
                async with httpx.AsyncClient(base_url=admin) as http:
                    refused = await http.post(f"/backends/{name}/drain", headers=headers)
                assert refused.status_code == 401, refused.text
            assert not backend.held
