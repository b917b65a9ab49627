"""The edge's own API key for its backends, against a stand-in started with `--api-key`.

The stand-in answers 401 as SGLang does to anything but `/health*`, `/metrics` and `OPTIONS`
without the key, and counts every request and every refusal by path, so each test sees which of
the edge's calls (health, loads, models, generation, abort) reached it with the key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from backends.credentials import BackendCredentials
from backends.sim import SimConfig, SimServer
from edge.config import ProxyConfig
from edge.reload import Reloader
from edge.routing.prewarm import PrewarmConfig
from edge.serve import build_parser, load_settings
from edge.settings import Settings
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


def rekey(sim: SimServer, key: str) -> None:
    """The stand-in restarted with `--api-key KEY`, as a rotation does to SGLang."""
    assert sim.api is not None
    sim.api._auth = b"Bearer " + key.encode()


def rewrite(path: str, text: str) -> None:
    Path(path).write_text(text)


def secret_volume(tmp_path: Path) -> str:
    """A Kubernetes Secret volume: `key` -> `..data/key`, `..data` -> `v1` (`key-a`); `v2`
    (`key-b`) waits for `swap_secret`. The key file's path."""
    for version, key in (("v1", "key-a"), ("v2", "key-b")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "key").write_text(key)
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "key").symlink_to("..data/key")
    return str(tmp_path / "key")


def swap_secret(tmp_path: Path) -> None:
    """The kubelet's update: `..data` pointed at `v2` at once (a rename over it)."""
    (tmp_path / "..new").symlink_to("v2")
    (tmp_path / "..new").rename(tmp_path / "..data")


def keyed_settings(tmp_path: Path, sim: SimServer, key_path: str) -> Callable[[], Settings]:
    """What `quicedge serve --config FILE --backend URL` reads on each reload: a file naming
    `key_path` as the fleet's key file."""
    config = tmp_path / "quicedge.toml"
    config.write_text(f'[proxy]\nbackend_api_key_file = "{key_path}"\n')
    argv = ["--config", str(config), "--backend", sim.url]
    return lambda: load_settings(build_parser().parse_args(argv), {})


async def test_a_reload_reads_the_rotated_key_for_every_call(tmp_path: Path) -> None:
    """The backend's key rotated (its Secret rewritten, SGLang restarted with the new key): a
    reload reads the file again, and requests, load polls, health checks, the model list and
    aborts carry the new key. The key was read once at start: every request got 502."""
    async with keyed_sim("key-a") as sim:
        path = key_file(tmp_path, "key-a\n")
        load = keyed_settings(tmp_path, sim, path)
        config = fast_config([sim.url], backend_api_key_file=path)
        async with run_edge(config) as edge, client(edge) as http:
            reloader = Reloader(load, load(), edge.wiring)
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            rekey(sim, "key-b")
            rewrite(path, "key-b\n")
            report = await reloader.reload_reported()
            assert sim.api is not None
            seen = sim.api.requests
            polls = seen["/v1/loads"]
            await wait_until(lambda: seen["/v1/loads"] >= polls + 2)  # one in flight: done
            refused = dict(sim.api.refused)
            statuses = [(await http.post("/v1/chat/completions", json=CHAT)).status_code
                        for _ in range(3)]  # fmt: skip
            edge.wiring.catalog.expire()
            models = await http.get("/v1/models")
            backend = edge.wiring.registry.backends[0]
            edge.wiring.abort(backend, "no-such-rid")
            checks = seen["/health"]
            await wait_until(lambda: seen["/abort_request"] >= 1 and seen["/v1/loads"] >= polls + 5)
            await wait_until(lambda: seen["/health"] >= checks + 2)
            healthy, failing = backend.healthy, backend.load_polls_failing
            await reloader.aclose()
        assert statuses == [200] * 3
        assert [m["id"] for m in models.json()["data"]] == [sim.config.model_name]
        assert sim.api.refused == refused, "a call after the reload carried the old key"
        assert healthy and failing == 0
        assert report == {"outcome": "applied", "changed": ["proxy.backend_api_keys"],
                          "restart_pending": [], "error": None}  # fmt: skip
        async with httpx.AsyncClient(base_url=sim.url) as http:  # the old key is refused
            old = await http.get("/v1/models", headers={"authorization": "Bearer key-a"})
            assert old.status_code == 401


@pytest.mark.parametrize("text", ["", "two words"])
async def test_a_key_file_broken_on_reload_keeps_the_running_key(tmp_path: Path, text: str) -> None:
    """An empty or malformed key file refuses the reload, naming the setting and the file, never
    the key; the running key serves on, and a reload once the file is fixed applies it."""
    async with keyed_sim("key-a") as sim:
        path = key_file(tmp_path, "key-a")
        load = keyed_settings(tmp_path, sim, path)
        config = fast_config([sim.url], backend_api_key_file=path)
        async with run_edge(config) as edge, client(edge) as http:
            reloader = Reloader(load, load(), edge.wiring)
            rewrite(path, text)
            report = await reloader.reload_reported()
            assert report["outcome"] == "refused"
            assert report["error"].startswith(f"proxy.backend_api_key_file: {path}")
            assert "key-a" not in report["error"]
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            rekey(sim, "key-b")
            rewrite(path, "key-b")
            assert (await reloader.reload_reported())["outcome"] == "applied"
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
            await reloader.aclose()
        assert 'quicedge_config_reloads_total{outcome="refused"} 1.0' in metrics


async def test_a_key_file_swapped_on_disk_is_read_when_polled(tmp_path: Path) -> None:
    """With `config_poll_interval`, the key files are watched as the config file is: a Secret
    volume's update (its `..data` symlink pointed at a new directory) is a reload."""
    async with keyed_sim("key-a") as sim:
        path = secret_volume(tmp_path)
        load = keyed_settings(tmp_path, sim, path)
        config = fast_config([sim.url], backend_api_key_file=path)
        async with run_edge(config) as edge, client(edge) as http:
            reloader = Reloader(
                load, load(), edge.wiring, path=str(tmp_path / "quicedge.toml"), poll_interval=0.05
            )
            reloader.start()
            rekey(sim, "key-b")
            swap_secret(tmp_path)
            await wait_until(lambda: edge.wiring.credentials.api_key(sim.url) == "key-b")
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            await reloader.aclose()


async def test_prewarm_carries_the_key(tmp_path: Path) -> None:
    """Pre-warming a backend that wants a key: its warm-up requests and its restart checks'
    `/metrics` go through the same pool as requests, with the edge's key (they had none: every
    warm-up got 401 and the backend never warmed)."""
    async with keyed_sim() as sim:
        config = fast_config([sim.url], policy="ttft",
                             backend_api_key_file=key_file(tmp_path, KEY))  # fmt: skip
        prewarm = PrewarmConfig(enabled=True, deadline=30.0, restart_check_interval=None)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            text = "the same system prompt, long enough to be a hot prefix " * 40
            sampling = {"max_new_tokens": 1}
            for i in range(4):
                r = await http.post(
                    "/generate", json={"text": f"{text}{i}", "sampling_params": sampling}
                )
                assert r.status_code == 200, r.text
            service = edge.wiring.fleet.prewarm if edge.wiring.fleet is not None else None
            assert service is not None
            backend = edge.wiring.registry.backends[0]
            assert service.warm_hot(backend, reason="restart") >= 1
            lanes = service.snapshot
            await wait_until(lambda: lanes()["backends"][backend.name]["state"] == "ready")
            lane = lanes()["backends"][backend.name]
        assert sim.api is not None and sim.api.refused == {}
        assert lane["requests"].get("ok", 0) >= 1, lane
