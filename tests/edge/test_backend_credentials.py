"""The edge's own API key for its backends, against a stand-in started with `--api-key`.

The stand-in answers 401 as SGLang does to anything but `/health*`, `/metrics` and `OPTIONS`
without the key, and counts every request and every refusal by path, so each test sees which of
the edge's calls (health, loads, models, generation, abort) reached it with the key."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backends.credentials import BackendCredentials
from backends.sim import SimConfig, SimServer
from edge.config import ProxyConfig
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.tls_edge import with_client_keys
from tests.helpers import wait_until

KEY = "sk-backend-7f3a"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def keyed_sim(key: str | None = KEY) -> SimServer:
    return SimServer(SimConfig(name="k", port=0, profile="instant", api_key=key))


def key_file(tmp_path: Path, text: str, name: str = "key") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


async def test_sim_requires_the_key_except_on_health() -> None:
    async with keyed_sim() as sim, httpx.AsyncClient(base_url=sim.url) as http:
        assert (await http.get("/health")).status_code == 200
        refused = await http.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 401
        assert refused.json() == {"error": "Unauthorized"}
        wrong = await http.get("/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


async def test_every_call_of_the_edge_carries_the_key(tmp_path: Path) -> None:
    async with keyed_sim() as sim:
        config = fast_config([sim.url], backend_api_key_file=key_file(tmp_path, KEY + "\n"))
        async with run_edge(config) as edge, client(edge) as http:
            whole = await http.post("/v1/chat/completions", json=CHAT)
            assert whole.status_code == 200, whole.text
            async with http.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as streamed:
                assert streamed.status_code == 200
                assert b"[DONE]" in b"".join([c async for c in streamed.aiter_bytes()])
            models = await http.get("/v1/models")
            assert [m["id"] for m in models.json()["data"]] == [sim.config.model_name]
            backend = edge.wiring.registry.backends[0]
            edge.wiring.abort(backend, "no-such-rid")
            assert sim.api is not None
            seen = sim.api.requests
            await wait_until(lambda: seen["/abort_request"] >= 1 and seen["/v1/loads"] >= 3)
            await wait_until(lambda: backend.load is not None)
            assert backend.healthy
        assert seen["/health"] >= 1
        assert seen["/v1/models"] >= 1
        assert seen["/v1/chat/completions"] == 2
        assert sim.api.refused == {}


async def test_without_a_key_the_client_key_is_not_forwarded() -> None:
    """A client presenting the backend's own key gets nothing through an edge that has none:
    the edge never forwards a client's `Authorization`."""
    async with keyed_sim() as sim:
        config = with_client_keys(fast_config([sim.url]), KEY)  # the edge admits the client
        async with run_edge(config) as edge, client(edge) as http:
            r = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"}
            )
            assert sim.api is not None
            await wait_until(lambda: sim.api is not None and sim.api.refused["/v1/loads"] >= 1)
        # the backend's refusal is the edge's set-up at fault, not the client's key: a 502
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "backend_unauthorized"
        assert sim.api.refused["/v1/chat/completions"] == 1


async def test_a_backend_that_refuses_the_edges_key_is_passed_over(tmp_path: Path) -> None:
    """One backend with another key than the edge's: its 401 is retried on the other backend,
    counted against it (kind `auth`), and never reaches the client."""
    async with keyed_sim("fleet-key") as good, keyed_sim("rotated") as bad:
        config = fast_config(
            [good.url, bad.url], policy="round_robin",
            backend_api_key_file=key_file(tmp_path, "fleet-key", "fleet"),
        )  # fmt: skip
        async with run_edge(config) as edge, client(edge) as http:
            statuses = [(await http.post("/v1/chat/completions", json=CHAT)).status_code
                        for _ in range(4)]  # fmt: skip
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
        assert statuses == [200] * 4
        assert bad.api is not None and bad.api.refused["/v1/chat/completions"] >= 1
        assert 'kind="auth"' in metrics


async def test_a_backend_key_overrides_the_fleet_key(tmp_path: Path) -> None:
    async with keyed_sim("fleet-key") as a, keyed_sim("own-key") as b:
        config = fast_config(
            [a.url, b.url],
            backend_api_key_file=key_file(tmp_path, "fleet-key", "fleet"),
            backend_api_key_files={b.url: key_file(tmp_path, "own-key", "b")},
        )
        async with run_edge(config) as edge, client(edge) as http:
            statuses = [(await http.post("/v1/chat/completions", json=CHAT)).status_code
                        for _ in range(4)]  # fmt: skip
        assert statuses == [200] * 4
        assert a.api is not None and b.api is not None
        assert a.api.requests["/v1/chat/completions"] == 2
        assert b.api.requests["/v1/chat/completions"] == 2
        assert a.api.refused == {} and b.api.refused == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is empty"), ("two words", "printable ASCII, no spaces")],
)
def test_a_bad_key_file_is_refused_by_its_setting(tmp_path: Path, text: str, message: str) -> None:
    path = key_file(tmp_path, text)
    with pytest.raises(ValueError, match=rf"proxy.backend_api_key_file: .*{message}"):
        ProxyConfig(backends=["http://127.0.0.1:1"], backend_api_key_file=path).validate()
    missing = str(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"proxy.backend_api_key_file: cannot read"):
        ProxyConfig(backends=["http://127.0.0.1:1"], backend_api_key_file=missing).validate()


def test_credentials_pick_the_backend_key_then_the_fleet_key() -> None:
    creds = BackendCredentials(b"f", {"http://b:1/": b"own"})
    assert creds.header("http://b:1") == (b"authorization", b"Bearer own")
    assert creds.header("http://a:1") == (b"authorization", b"Bearer f")
    assert creds.api_key("http://b:1") == "own"
    assert not BackendCredentials()
    assert BackendCredentials().with_auth("http://a:1", []) == []
