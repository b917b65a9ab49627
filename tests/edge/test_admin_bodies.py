"""What the admin port answers to a body or method it does not take: a clear 4xx, never a 500,
served as `quicedge serve` serves it (on our own HTTP/1.1 listener, behind `guard_actions`)."""

from __future__ import annotations

import httpx

from edge.admin import guard_actions
from edge.routing.prewarm import PrewarmConfig
from tests.edge.conftest import fast_config, h1_app, run_edge
from tests.edge.routing.test_prewarm import sim_config, sims


async def test_a_prewarm_body_nested_too_deep_is_a_400_not_a_500() -> None:
    """`json.loads` recursed until Python's limit and raised RecursionError: a 500 and a
    traceback in the log for 100 kB of `[`."""
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        async with (
            run_edge(config, prewarm=prewarm) as edge,
            h1_app(guard_actions(edge.wiring.admin_app, None)) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            for body in (b"[" * 100_000, b'{"text":' * 50_000):
                answer = await http.post("/prewarm", content=body)
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["code"] == "invalid_json"
            # A lone surrogate is no text to warm (and no UTF-8 to send a backend).
            answer = await http.post("/prewarm", content=b'{"text": "\\ud800"}')
            assert answer.status_code == 400, answer.text
            # The route still serves a good body after them.
            answer = await http.post("/prewarm", json={"text": "hello there"})
            assert answer.status_code == 200, answer.text


async def test_prewarm_refuses_another_method_with_allow() -> None:
    """Every other admin 405 names the method it takes (`allow`, as RFC 9110 requires);
    `/prewarm`'s did not."""
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        async with (
            run_edge(config, prewarm=prewarm) as edge,
            h1_app(guard_actions(edge.wiring.admin_app, None)) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            for method in ("GET", "HEAD", "PUT"):
                answer = await http.request(method, "/prewarm")
                assert answer.status_code == 405, answer.text
                assert answer.headers.get("allow") == "POST", answer.headers


async def test_a_backend_named_again_in_a_prewarm_is_warmed_once() -> None:
    """Each name in `backends` queued one more warm-up on that backend: one call of 8 MiB,
    `["b0", "b0", ...]`, sent that backend a request per name (here 50 for one)."""
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        name = servers[0].url.removeprefix("http://")
        async with (
            run_edge(config, prewarm=prewarm) as edge,
            h1_app(guard_actions(edge.wiring.admin_app, None)) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            api = servers[0].api
            assert api is not None
            before = api.requests["/generate"]
            answer = await http.post("/prewarm", json={"text": "hello", "backends": [name] * 50})
            assert answer.status_code == 200, answer.text
            assert answer.json()["backends"][name]["requests"] == 1, answer.text
            # (the answer waits for the last job queued: every one before it was sent)
            assert api.requests["/generate"] - before == 1
