"""Every answer of the API listener carries `x-request-id`: the client's when it sent a
well-formed one, else one the edge makes; the access log's line of it names the same id."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from backends.sim import SimServer
from edge.access_log import AccessLog, AccessLogConfig
from tests.edge.conftest import LISTENERS, client, fast_config, run_edge
from tests.edge.state.helpers import state
from tests.edge.test_access_log import Lines
from tests.edge.test_app_sim import sim_config
from tests.edge.test_h3_end_to_end import h3_edge
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect

# (method, path, body, status): answers outside the inference routes' own path.
ANSWERS: list[tuple[str, str, Any, int]] = [
    ("GET", "/nope", None, 404),
    ("PUT", "/v1/chat/completions", None, 405),
    ("DELETE", "/v1/models", None, 405),
    ("GET", "/v1/models", None, 200),
    ("HEAD", "/v1/models", None, 200),
    ("GET", "/v1/models/default", None, 200),
    ("GET", "/v1/models/no-such-model", None, 404),
    ("POST", "/v1/conversations", {}, 200),
    ("GET", "/v1/conversations/conv_none", None, 404),
    ("GET", "/v1/responses/resp_none", None, 404),
    ("GET", "/v1/chat/completions/chatcmpl-none", None, 404),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),  # an inference route's refusal
]


async def _answer(http: httpx.AsyncClient, method: str, path: str, body: Any,
                  headers: dict[str, str]) -> httpx.Response:  # fmt: skip
    return await http.request(method, path, json=body, headers=headers)


@LISTENERS
async def test_every_answer_carries_the_request_id_and_its_log_line_too(listener: str) -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(None))
        async with run_edge(config, listener=listener, access_log=AccessLogConfig(),
                            start=False) as edge:  # fmt: skip
            lines = Lines()  # what the access log writes
            log = AccessLog(AccessLogConfig(), handler=lines)
            edge.wiring.access_log = log
            edge.wiring.app.access_log = log  # type: ignore[attr-defined]
            await edge.wiring.start()
            async with client(edge) as http:
                sent: list[str] = []
                for n, (method, path, body, status) in enumerate(ANSWERS):
                    rid = f"rid-{listener}.{n}:x_y"
                    answer = await _answer(http, method, path, body, {"x-request-id": rid})
                    assert answer.status_code == status, (method, path, answer.text)
                    assert answer.headers.get("x-request-id") == rid, (method, path)
                    sent.append(rid)
                    made = await _answer(http, method, path, body, {})
                    assert made.status_code == status, (method, path, made.text)
                    assert re.fullmatch(r"[0-9a-f]{32}", made.headers.get("x-request-id", ""))
                    sent.append(made.headers["x-request-id"])
                for path in ("/v1/chat/completions", "/nope"):  # a malformed id: a new one
                    bad = await http.post(path, json={}, headers={"x-request-id": "bad id"})
                    assert bad.headers.get("x-request-id", "bad id") != "bad id"
                    sent.append(bad.headers["x-request-id"])
            await wait_until(lambda: len(lines.lines) == len(sent))
            assert [line.get("request_id") for line in lines.lines] == sent


@LISTENERS
@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/default"])
async def test_a_malformed_request_id_is_never_echoed(listener: str, path: str) -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(None))
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            bad = "bad id with spaces"
            answer = await http.get(path, headers={"x-request-id": bad})
            assert answer.status_code == 200
            assert re.fullmatch(r"[0-9a-f]{32}", answer.headers.get("x-request-id", ""))
            refused = await http.post("/v1/chat/completions", json={"messages": []},
                                      headers={"x-request-id": bad})  # fmt: skip
            assert refused.status_code == 400 and "invalid_request_id" in refused.text
            assert re.fullmatch(r"[0-9a-f]{32}", refused.headers.get("x-request-id", ""))


async def test_answers_over_http3_carry_the_request_id(dev_certs: Any) -> None:
    """The same over the HTTP/3 listener: the model list, a 404 and a 405 echo the client's id."""
    async with SimServer(sim_config("b1")) as sim, h3_edge(dev_certs, sim) as (_, server):
        async with h3_connect(server.port, dev_certs.ca_cert) as h3:
            for n, (method, path, status) in enumerate(
                [("GET", "/v1/models", 200), ("GET", "/nope", 404), ("DELETE", "/v1/models", 405)]
            ):
                rid = f"h3-{n}".encode()
                answer = await h3.fetch(method, path, headers=[(b"x-request-id", rid)])
                assert (answer.status, answer.header(b"x-request-id")) == (status, rid), path


async def test_a_cors_preflight_carries_the_request_id(dev_certs: Any) -> None:
    """The edge's own preflight answers (204, and 403 to an origin not allowed) echo the
    client's well-formed id and give a new one otherwise, as every other answer."""
    from edge.cors import CorsConfig
    from tests.edge.test_cors import PREFLIGHT, stand_in
    from tests.edge.tls_edge import tls_edge

    cors = CorsConfig(origins=[PREFLIGHT["origin"]])
    async with stand_in() as sim, tls_edge(fast_config([sim.url]), dev_certs, cors=cors) as edge:
        async with httpx.AsyncClient(http2=True, verify=edge.ssl_context) as http:
            url = edge.url + "/v1/chat/completions"
            other = {**PREFLIGHT, "origin": "https://elsewhere.example"}
            for headers, status in ((PREFLIGHT, 204), (other, 403)):
                mine = await http.options(url, headers={**headers, "x-request-id": "pf-1:a_b"})
                assert (mine.status_code, mine.headers.get("x-request-id")) == (status, "pf-1:a_b")
                for extra in ({}, {"x-request-id": "bad id"}):
                    fresh = await http.options(url, headers={**headers, **extra})
                    assert fresh.status_code == status
                    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers.get("x-request-id", ""))
