"""The admin token's `Authorization` scheme is matched as HTTP defines it (RFC 9110, 11.1: a
case-insensitive token), as a tenant's `bearer KEY` is; the token itself is matched exactly."""

from __future__ import annotations

import httpx

from edge.admin import guard_actions
from tests.edge.conftest import TinyUpstream, fast_config, h1_app, health_ok, run_edge


async def test_the_scheme_of_the_admin_token_is_case_insensitive() -> None:
    async with TinyUpstream(health_ok) as up, run_edge(fast_config([up.url])) as edge:
        name = up.url.removeprefix("http://")
        (backend,) = edge.wiring.registry.backends
        async with (
            h1_app(guard_actions(edge.wiring.admin_app, b"s3cret")) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            for wrong in ("bearer S3CRET", "Basic s3cret", "Bearer s3cret2", "Bearers3cret",
                          "s3cret", "Bearer"):  # fmt: skip
                refused = await http.post(f"/backends/{name}/drain",
                                          headers={"authorization": wrong})  # fmt: skip
                assert refused.status_code == 401, (wrong, refused.text)
            assert not backend.held
            for scheme in ("bearer", "BEARER"):
                taken = await http.post(
                    f"/backends/{name}/drain", headers={"authorization": f"{scheme} s3cret"}
                )
                assert taken.status_code == 200, (scheme, taken.text)
                assert backend.held
                backend.held = False
