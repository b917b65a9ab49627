"""A DNS-rebinding page (served from `rebound.example:9901`, then resolved to the admin address)
is the admin port's own origin: whatever it loads from there it can read, a navigation it makes
in a frame or a window it opened included, not only a `fetch`. Served, as `quicedge serve`
serves the admin port, on our own HTTP/1.1 listener behind `guard_actions`."""

from __future__ import annotations

import httpx

from edge.admin import guard_actions
from tests.edge.conftest import TinyUpstream, fast_config, h1_app, health_ok, run_edge

HOST = {"host": "rebound.example:9901"}
FRAME = {**HOST, "sec-fetch-site": "same-origin", "sec-fetch-mode": "navigate",
         "sec-fetch-dest": "iframe"}  # fmt: skip
"""What a browser sends for `<iframe src="/tenants">` on the rebound page."""
OPENED = {**HOST, "sec-fetch-site": "same-origin", "sec-fetch-mode": "navigate",
          "sec-fetch-dest": "document"}  # fmt: skip
"""... and for `window.open("/tenants")`: a top-level navigation the opener can read."""


async def test_a_rebinding_page_cannot_read_through_a_frame_or_a_window_it_opens() -> None:
    async with TinyUpstream(health_ok) as up, run_edge(fast_config([up.url])) as edge:
        for token in (None, b"s3cret"):
            async with (
                h1_app(guard_actions(edge.wiring.admin_app, token)) as admin,
                httpx.AsyncClient(base_url=admin) as http,
            ):
                for headers in (FRAME, OPENED):
                    for path in ("/backends", "/tenants", "/rollouts", "/metrics"):
                        read = await http.get(path, headers=headers)
                        assert read.status_code == 403, (path, headers, read.text)
                        assert read.json()["error"]["code"] == "browser_request"
                # A link followed from another site's page: that page cannot read the answer,
                # which is the operator's to see; as is a URL typed or bookmarked.
                for site in ("cross-site", "same-site", "none"):
                    nav = {"sec-fetch-site": site, "sec-fetch-mode": "navigate",
                           "sec-fetch-dest": "document"}  # fmt: skip
                    assert (await http.get("/backends", headers=nav)).status_code == 200, site
                assert (await http.get("/health")).status_code == 200
