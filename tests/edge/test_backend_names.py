"""Internal backend addresses stay inside the edge unless an operator turns
`expose_backend_names` on: no `x-quicedge-backend` header, and error messages name no address."""

from __future__ import annotations

import pytest

from tests.edge.conftest import TinyUpstream, client, fast_config, run_edge, sse_reply
from tests.helpers import free_port

COMPLETION = {"model": "default", "prompt": "Hello", "stream": True}


@pytest.mark.parametrize("expose", [False, True])
async def test_the_backend_is_named_only_when_exposed(expose: bool) -> None:
    async with TinyUpstream(lambda r: sse_reply(["hi"])) as up:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect refused
        async with run_edge(fast_config([up.url], expose_backend_names=expose)) as edge:
            async with client(edge) as http:
                ok = await http.post("/v1/completions", json=COMPLETION)
        async with run_edge(
            fast_config([dead], expose_backend_names=expose, max_retries=0), start=False
        ) as edge:
            async with client(edge) as http:
                failed = await http.post("/v1/completions", json=COMPLETION)
    assert ok.status_code == 200
    assert failed.status_code == 502
    message = failed.json()["error"]["message"]
    address = dead.removeprefix("http://")
    if expose:
        assert ok.headers["x-quicedge-backend"] == f"127.0.0.1:{up.port}"
        assert address in message
    else:
        assert "x-quicedge-backend" not in ok.headers
        assert address not in message and "127.0.0.1" not in message
        assert message.startswith("could not connect to a backend")
