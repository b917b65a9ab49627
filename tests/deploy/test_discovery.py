"""Discovery against a real DNS server and a stand-in Kubernetes API: backends come and go
while the edge serves, and a removed one finishes what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dnslib import QTYPE
from prometheus_client import CollectorRegistry

from backends.discovery import (
    Discovery,
    DiscoveryConfig,
    DiscoveryMetrics,
    DnsSource,
    KubernetesSource,
    ready_endpoints,
)
from backends.registry import BackendRegistry
from backends.sim import SimConfig, SimServer
from certs import ensure_dev_certificates
from edge.wiring import Wiring, build
from tests.deploy.dns_server import Zone, dns_server
from tests.deploy.processes import completion, sim_process, wait_ready
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, hypercorn_app
from tests.helpers import free_port, wait_until
from tests.transport.conftest import ServeProcess

SRV_NAME = "_sglang._tcp.fleet.test"


def dns_config(server: str, *names: str, **extra: Any) -> DiscoveryConfig:
    return DiscoveryConfig.from_mapping(
        {"mode": "dns", "names": list(names), "nameservers": [server], "interval": 0.2,
         "timeout": 2.0, **extra}
    )  # fmt: skip


async def test_a_and_aaaa_records_give_one_backend_per_address() -> None:
    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.1", "127.0.0.2"])
        zone.set("sglang.fleet.test", "AAAA", ["::1"])
        found = await DnsSource(dns_config(server, "sglang.fleet.test:30000")).lookup()
    assert found == {
        "sglang.fleet.test:30000": {
            "http://127.0.0.1:30000",
            "http://127.0.0.2:30000",
            "http://[::1]:30000",
        }
    }


async def test_srv_records_give_their_targets_ports() -> None:
    with dns_server() as (zone, server):
        zone.set(SRV_NAME, "SRV", [(30001, "a.fleet.test"), (30002, "b.fleet.test")])
        zone.set("a.fleet.test", "A", ["127.0.0.1"])
        zone.set("b.fleet.test", "A", ["127.0.0.3"])
        found = await DnsSource(dns_config(server, SRV_NAME)).lookup()
        zone.set(SRV_NAME, "SRV", [])
        zone.set("a.fleet.test", "A", [])
        zone.set("b.fleet.test", "A", [])
        gone = await DnsSource(dns_config(server, SRV_NAME)).lookup()
    assert found == {SRV_NAME: {"http://127.0.0.1:30001", "http://127.0.0.3:30002"}}
    assert gone == {SRV_NAME: set()}  # NXDOMAIN: authoritatively empty


async def test_a_failed_lookup_keeps_the_backends_it_held() -> None:
    """...and is counted: kept backends say nothing of a name whose lookups all fail."""
    name = "sglang.fleet.test:30000"
    metrics = CollectorRegistry()

    def sample(metric: str, **labels: str) -> float | None:
        return metrics.get_sample_value(metric, {"name": name, **labels})

    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.1"])
        config = dns_config(server, name, timeout=0.5)
        discovery = Discovery(config, DnsSource(config), DiscoveryMetrics(metrics))
        assert await discovery.initial([]) == ["http://127.0.0.1:30000"]
        registry = BackendRegistry(["http://127.0.0.1:30000"], pool=None)
    assert sample("quicedge_discovery_lookups_total", outcome="ok") == 1.0
    assert sample("quicedge_discovery_backends") == 1.0
    # The server is gone: the lookup times out, and nothing is removed.
    await discovery.refresh(registry)
    assert [b.url for b in registry.backends] == ["http://127.0.0.1:30000"]
    assert not registry.backends[0].draining
    assert sample("quicedge_discovery_lookups_total", outcome="failed") == 1.0
    assert sample("quicedge_discovery_backends") == 1.0  # what it last held, still served


async def test_an_srv_target_that_no_longer_resolves_is_left_out_and_the_others_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pod gone while the SRV answer still names it (or one wrong record): its name answers
    NXDOMAIN, which says nothing of the service's other targets."""
    with dns_server() as (zone, server):
        zone.set(SRV_NAME, "SRV", [(30000, f"pod-{x}.fleet.test") for x in "abc"])
        for i, x in enumerate("abc", start=1):
            zone.set(f"pod-{x}.fleet.test", "A", [f"10.0.0.{i}"])
        config = dns_config(server, SRV_NAME, drain_timeout=0.0)
        discovery = Discovery(config, DnsSource(config))
        registry = BackendRegistry(await discovery.initial([]), pool=None)
        assert len(registry.backends) == 3
        zone.set("pod-c.fleet.test", "A", [])
        with caplog.at_level("WARNING", logger="backends.discovery"):
            await discovery.refresh(registry)
    await wait_until(lambda: len(registry.backends) == 2)  # pod-c's drained and removed
    serving = sorted(b.url for b in registry.backends if not b.draining)
    assert serving == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert "pod-c.fleet.test: no address record" in caplog.text


class SlowZone(Zone):
    """A zone whose server takes `delays[type]` seconds to answer a query of that type."""

    def __init__(self) -> None:
        super().__init__()
        self.delays: dict[str, float] = {}

    def resolve(self, request: Any, handler: Any) -> Any:
        time.sleep(self.delays.get(QTYPE[request.q.qtype], 0.0))  # the server's own thread
        return super().resolve(request, handler)


@contextlib.contextmanager
def slow_dns_server() -> Iterator[tuple[SlowZone, str]]:
    """`dns_server`, with a `SlowZone`."""
    with dns_server(SlowZone()) as served:
        yield served


async def test_a_lookup_asks_its_targets_at_once_within_the_timeout() -> None:
    """Six targets whose every answer takes 0.3 s: asked one after another (SRV, then A and
    AAAA of each) the lookup would take 3.9 s, twice its 2 s bound."""
    with slow_dns_server() as (zone, server):
        zone.set(SRV_NAME, "SRV", [(30000, f"pod-{i}.fleet.test") for i in range(6)])
        for i in range(6):
            zone.set(f"pod-{i}.fleet.test", "A", [f"10.0.0.{i + 1}"])
        zone.delays = {"SRV": 0.3, "A": 0.3, "AAAA": 0.3}
        source = DnsSource(dns_config(server, SRV_NAME, timeout=2.0))
        started = time.monotonic()
        found = await source.lookup()
        took = time.monotonic() - started
        assert found == {SRV_NAME: {f"http://10.0.0.{i + 1}:30000" for i in range(6)}}
        assert took < 3.0, took
        # Slower than the bound: the lookup fails at the bound, keeping what the name held.
        zone.delays = {"SRV": 0.3, "A": 2.0, "AAAA": 2.0}
        source = DnsSource(dns_config(server, SRV_NAME, timeout=1.0))
        started = time.monotonic()
        assert await source.lookup() == {SRV_NAME: None}
        assert time.monotonic() - started < 3.0


async def test_a_family_that_does_not_answer_leaves_the_other_one_serving() -> None:
    """A resolver that drops AAAA queries: the A answer serves. One that answered both and then
    loses an AAAA answer: the AAAA address stays (a lost answer drains nothing)."""
    name = "sglang.fleet.test:30000"
    with slow_dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.1"])
        zone.set("sglang.fleet.test", "AAAA", ["::1"])
        zone.delays = {"AAAA": 2.0}
        dropped = DnsSource(dns_config(server, name, timeout=0.5))
        assert await dropped.lookup() == {name: {"http://127.0.0.1:30000"}}
        assert dropped.partial == {name}  # counted as such by `Discovery`
        zone.delays = {}
        source = DnsSource(dns_config(server, name, timeout=0.5))
        both = {"http://127.0.0.1:30000", "http://[::1]:30000"}
        assert await source.lookup() == {name: both}
        assert source.partial == set()
        zone.delays = {"AAAA": 2.0}
        zone.set("sglang.fleet.test", "A", ["127.0.0.2"])
        assert await source.lookup() == {name: {"http://127.0.0.2:30000", "http://[::1]:30000"}}
        assert source.partial == {name}
        zone.delays = {"A": 2.0, "AAAA": 2.0}  # neither answers: the name keeps its backends
        assert await DnsSource(dns_config(server, name, timeout=0.5)).lookup() == {name: None}
        # Nor with answers from before to stand in: a failed lookup, not an answer.
        assert await source.lookup() == {name: None}


def test_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="discovery.names: mode dns needs at least one name"):
        DiscoveryConfig.from_mapping({"mode": "dns"})
    with pytest.raises(ValueError, match="discovery: unknown setting"):
        DiscoveryConfig.from_mapping({"mode": "dns", "name": ["x"]})
    with pytest.raises(ValueError, match="discovery.mode"):
        DiscoveryConfig.from_mapping({"mode": "consul", "names": ["x"]})
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        DiscoveryConfig.from_mapping({"mode": "dns", "names": ["sglang"]})
    with pytest.raises(ValueError, match="discovery.interval"):
        DiscoveryConfig.from_mapping({"mode": "dns", "names": ["a:1"], "interval": 0})
    with pytest.raises(ValueError, match="discovery.nameservers"):
        DiscoveryConfig.from_mapping({"mode": "dns", "names": ["a:1"], "nameservers": ["x"]})
    with pytest.raises(ValueError, match="the same port"):
        DiscoveryConfig.from_mapping(
            {"mode": "dns", "names": ["a:1"], "nameservers": ["10.0.0.1", "10.0.0.2:5353"]}
        )
    assert DiscoveryConfig.from_mapping({}).mode == "static"


@contextlib.asynccontextmanager
async def edge_with(discovery: DiscoveryConfig) -> AsyncIterator[tuple[Wiring, str]]:
    proxy = fast_config(["http://127.0.0.1:1"])
    proxy.backends = []  # every backend comes from discovery
    wiring = await build(proxy, registry=CollectorRegistry(), discovery=discovery)
    await wiring.start()
    try:
        async with hypercorn_app(wiring.app) as url:
            yield wiring, url
    finally:
        await wiring.aclose()


# ~6 ms a token: the 600-token answer below takes seconds, far longer than discovery's turn.
PACED = SimConfig(host="127.0.0.1", port=0, profile="h100-llama3-8b", time_scale=1.0)


async def test_backends_join_and_a_removed_one_drains_what_it_holds() -> None:
    async with SimServer(PACED) as one, SimServer(PACED) as two:
        with dns_server() as (zone, server):
            zone.set(SRV_NAME, "SRV", [(one.port, "one.fleet.test")])
            zone.set("one.fleet.test", "A", ["127.0.0.1"])
            zone.set("two.fleet.test", "A", ["127.0.0.1"])
            config = dns_config(server, SRV_NAME, drain_timeout=30.0)
            async with edge_with(config) as (wiring, url):
                registry = wiring.registry
                assert [b.url for b in registry.backends] == [one.url]
                zone.set(
                    SRV_NAME, "SRV", [(one.port, "one.fleet.test"), (two.port, "two.fleet.test")]
                )
                await wait_until(lambda: {b.url for b in registry.backends} == {one.url, two.url})
                # A long answer in flight on `one` while DNS stops naming it.
                body = {"model": "default", "prompt": "Hello", "max_tokens": 600,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        chunks = r.aiter_bytes()
                        received = [await anext(chunks)]
                        holder = next(b for b in registry.backends if b.in_flight)
                        zone.set(SRV_NAME, "SRV", [
                            (b.port, f"{n}.fleet.test")
                            for b, n in ((one, "one"), (two, "two")) if b.url != holder.url
                        ])  # fmt: skip
                        await wait_until(lambda: holder.draining)
                        assert holder.in_flight == 1 and holder in registry.backends
                        assert holder not in registry.candidates()
                        received.extend([c async for c in chunks])
                    assert r.status_code == 200
                    text = b"".join(received)
                    assert text.rstrip().endswith(b"data: [DONE]")
                    assert text.count(b'"text"') >= 600
                    await wait_until(lambda: holder not in registry.backends)
                    # The one that stayed serves new requests.
                    r = await client.post("/v1/completions", json={**body, "stream": False})
                    assert r.status_code == 200
                    remaining = registry.backends
                    assert len(remaining) == 1 and remaining[0].url != holder.url
                    assert remaining[0].requests == 1


def slices(*endpoints: tuple[str, bool | None], port: int = 30000) -> dict[str, Any]:
    items = []
    for address, ready in endpoints:
        conditions = {} if ready is None else {"ready": ready}
        items.append({"addresses": [address], "conditions": conditions})
    return {
        "kind": "EndpointSliceList",
        "items": [{"ports": [{"name": "http", "port": port}], "endpoints": items}],
    }


def test_ready_endpoints_skip_those_not_ready() -> None:
    listed = slices(("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None))
    assert ready_endpoints(listed, "http") == {"http://10.0.0.1:30000", "http://10.0.0.3:30000"}
    assert ready_endpoints(listed, "metrics") == set()


async def test_kubernetes_slices_are_listed_with_the_service_account(tmp_path: Path) -> None:
    answer: dict[str, Any] = {
        "status": 200,
        "body": slices(("127.0.0.1", True), ("127.0.0.2", True)),
    }

    def api(recorded: Recorded) -> Reply:
        return Reply(status=answer["status"], chunks=[json.dumps(answer["body"]).encode()],
                     chunked=False, headers=[("content-type", "application/json")])  # fmt: skip

    token = tmp_path / "token"
    token.write_text("service-account-token\n")
    async with TinyUpstream(api) as server:
        config = DiscoveryConfig.from_mapping(
            {"mode": "kubernetes", "names": ["inference/sglang"], "api_url": server.url,
             "token_file": str(token), "port_name": "http", "interval": 0.2}
        )  # fmt: skip
        discovery = Discovery(config, KubernetesSource(config))
        urls = await discovery.initial([])
        assert urls == ["http://127.0.0.1:30000", "http://127.0.0.2:30000"]
        request = server.requests[0]
        assert request.path == (
            "/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
            "?labelSelector=kubernetes.io%2Fservice-name%3Dsglang"
        )
        assert request.headers["authorization"] == "Bearer service-account-token"
        registry = BackendRegistry(urls, pool=None)
        answer["body"] = slices(("127.0.0.1", True), ("127.0.0.2", False))
        await discovery.refresh(registry)
        await wait_until(lambda: len(registry.backends) == 1)
        assert registry.backends[0].url == "http://127.0.0.1:30000"
        # An API server that fails changes nothing: the endpoint it held stays.
        answer.update(status=500, body={"kind": "Status", "code": 500})
        await discovery.refresh(registry)
        assert [b.url for b in registry.backends] == ["http://127.0.0.1:30000"]
        assert not registry.backends[0].draining and len(server.requests) == 3


def test_serve_with_two_workers_finds_its_backends_by_dns(tmp_path: Path, redis_url: str) -> None:
    """The `[discovery]` table through `quicedge serve --config`, as the compose stack runs it."""
    http_port = free_port()
    with dns_server() as (zone, server), sim_process() as backend:
        port = backend.rsplit(":", 1)[1]
        zone.set("sim.fleet.test", "A", ["127.0.0.1"])
        config = tmp_path / "edge.toml"
        config.write_text(
            f'[discovery]\nmode = "dns"\nnames = ["sim.fleet.test:{port}"]\n'
            f'nameservers = ["{server}"]\ninterval = 0.5\n'
        )
        edge = ServeProcess(
            "--config", str(config), "--workers", "2", "--redis", redis_url,
            "--http", f"127.0.0.1:{http_port}",
        )  # fmt: skip
        try:
            wait_ready(edge.admin_port)
            statuses = [completion(f"http://127.0.0.1:{http_port}") for _ in range(8)]
            assert statuses == [200] * 8
            metrics = httpx.get(f"http://127.0.0.1:{edge.admin_port}/metrics", timeout=10).text
            healthy = [
                line for line in metrics.splitlines()
                if line.startswith("quicedge_backend_healthy{") and line.endswith(" 1.0")
            ]  # fmt: skip
            assert len(healthy) == 2  # each worker found the one backend
            assert all(f'backend="127.0.0.1:{port}"' in line for line in healthy)
        finally:
            assert edge.stop() == 0


class TlsApi(TinyUpstream):
    """The stand-in API server over TLS, as the real one is."""

    def __init__(self, script: Any, context: ssl.SSLContext) -> None:
        super().__init__(script)
        self.context = context

    async def __aenter__(self) -> TlsApi:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


async def test_kubernetes_slices_over_tls_verify_the_api_servers_certificate(
    dev_certs: Any, tmp_path: Path
) -> None:
    def api(recorded: Recorded) -> Reply:
        return Reply(chunks=[json.dumps(slices(("127.0.0.1", True))).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(dev_certs.cert, dev_certs.key)
    async with TlsApi(api, context) as server:
        base = {"mode": "kubernetes", "names": ["sglang"], "namespace": "inference",
                "api_url": f"https://localhost:{server.port}",
                "token_file": str(tmp_path / "none")}  # fmt: skip
        trusted = DiscoveryConfig.from_mapping({**base, "ca_file": str(dev_certs.ca_cert)})
        found = await KubernetesSource(trusted).lookup()
        assert found == {"sglang": {"http://127.0.0.1:30000"}}
        assert "authorization" not in server.requests[0].headers  # no token file, no token
        # A CA that did not sign the API server's certificate: the lookup fails, nothing changes.
        other = tmp_path / "other-ca.pem"
        other.write_bytes(ensure_dev_certificates(tmp_path / "other").ca_cert.read_bytes())
        untrusted = DiscoveryConfig.from_mapping({**base, "ca_file": str(other)})
        assert await KubernetesSource(untrusted).lookup() == {"sglang": None}


def test_serve_says_at_once_that_kubernetes_discovery_needs_a_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge.serve import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = tmp_path / "edge.toml"
    config.write_text('[discovery]\nmode = "kubernetes"\nnames = ["sglang"]\n')
    assert main(["--config", str(config)]) == 2
    assert "discovery.api_url: not in a cluster" in capsys.readouterr().err


async def test_a_names_labels_go_with_every_backend_it_finds() -> None:
    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.1", "127.0.0.2"])
        zone.set(SRV_NAME, "SRV", [(30001, "a.fleet.test")])
        zone.set("a.fleet.test", "A", ["127.0.0.3"])
        plain = "sglang.fleet.test:30000#hardware=h100&tiers=gold+silver"
        srv = f"{SRV_NAME}#model=llama@v2"
        found = await DnsSource(dns_config(server, plain, srv)).lookup()
    assert found == {
        plain: {
            "http://127.0.0.1:30000#hardware=h100&tiers=gold+silver",
            "http://127.0.0.2:30000#hardware=h100&tiers=gold+silver",
        },
        srv: {"http://127.0.0.3:30001#model=llama@v2"},
    }


def test_bad_labels_on_a_name_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"discovery.names: 'a:1#zone=x': label 'zone=x'"):
        DiscoveryConfig.from_mapping({"mode": "dns", "names": ["a:1#zone=x"]})
    with pytest.raises(ValueError, match="discovery.names: 'svc#tiers=gold\\+iron': tiers"):
        DiscoveryConfig.from_mapping({"mode": "kubernetes", "names": ["svc#tiers=gold+iron"]})


def labelled_slices(labels: dict[str, str], *addresses: str) -> dict[str, Any]:
    listed = slices(*((a, True) for a in addresses))
    listed["items"][0]["metadata"] = {"name": "sglang-abc12", "labels": labels}
    return listed


def test_a_slices_service_labels_are_its_endpoints_labels() -> None:
    service = {
        "kubernetes.io/service-name": "sglang",
        "app": "sglang",
        "quicedge.io/model": "llama-3-8b",
        "quicedge.io/model-version": "v2",
        "quicedge.io/hardware": "h100",
        "quicedge.io/tiers": "gold-silver",
    }
    listed = labelled_slices(service, "10.0.0.1")
    assert ready_endpoints(listed, "http") == {
        "http://10.0.0.1:30000#hardware=h100&model=llama-3-8b@v2&tiers=gold+silver"
    }
    # The name's own labels win over the slice's.
    assert ready_endpoints(listed, "http", {"hardware": "a100"}) == {
        "http://10.0.0.1:30000#hardware=a100&model=llama-3-8b@v2&tiers=gold+silver"
    }
    # A tier Kubernetes names that the edge does not know: that label only is dropped.
    odd = labelled_slices({"quicedge.io/tiers": "gold.iron", "quicedge.io/hardware": "h200"}, "b")
    assert ready_endpoints(odd, None) == {"http://b:30000#hardware=h200"}


async def test_discovered_labels_place_backends_in_their_pools_tiers_and_domains() -> None:
    """Through the edge: a DNS name labelled `model=gamma@v7&hardware=h200` and an EndpointSlice
    whose Service says `quicedge.io/model: beta` and `quicedge.io/tiers: gold` (the name adds
    `hardware=a100`). Each backend is
    in its model pool and breaker domain; the gold-only one serves a gold tenant, never bronze."""
    from edge.admission.settings import AdmissionSettings, TenantSettings
    from edge.admission.tenants import key_digest
    from edge.routing.breakers import BreakerConfig
    from tests.edge.conftest import client, run_edge
    from tests.edge.models.test_pools_e2e import chat, netloc, sim, sims

    async with sims(sim("alpha"), sim("beta")) as (a, b):

        def api(recorded: Recorded) -> Reply:
            service = {"quicedge.io/model": "beta", "quicedge.io/tiers": "gold"}
            listed = labelled_slices(service, "127.0.0.1")
            listed["items"][0]["ports"][0]["port"] = b.port
            return Reply(chunks=[json.dumps(listed).encode()], chunked=False,
                         headers=[("content-type", "application/json")])  # fmt: skip

        async with TinyUpstream(api) as k8s:
            with dns_server() as (zone, server):
                zone.set("one.fleet.test", "A", ["127.0.0.1"])
                dns = dns_config(server, f"one.fleet.test:{a.port}#model=gamma@v7&hardware=h200")
                kube = DiscoveryConfig.from_mapping(
                    {"mode": "kubernetes", "names": ["inference/sglang#hardware=a100"],
                     "api_url": k8s.url, "token_file": "/nonexistent"}
                )  # fmt: skip
                # Two sources feed one registry: the DNS one builds the edge, the slice is
                # added as discovery adds it at run time.
                config = fast_config(["http://127.0.0.1:1"])
                config.backends = []
                config.admission = AdmissionSettings(tenants=[TenantSettings(
                    name="acme", tier="gold", api_key_sha256=[key_digest("sk-gold")]
                )])  # fmt: skip
                async with run_edge(config, discovery=dns, breakers=BreakerConfig()) as edge:
                    registry = edge.wiring.registry
                    sliced = Discovery(kube, KubernetesSource(kube))
                    for url in await sliced.initial([]):
                        registry.add(url)
                    backends = {x.name: x for x in registry.backends}
                    ga, gb = backends[netloc(a)], backends[netloc(b)]
                    assert (ga.model, ga.model_version, ga.hw_group) == ("gamma", "v7", "h200")
                    assert (gb.model, gb.hw_group, gb.labels["tiers"]) == ("beta", "a100", "gold")
                    async with client(edge) as http:
                        r = await http.post("/v1/chat/completions", json=chat("gamma"))
                        assert r.status_code == 200, r.text
                        assert r.headers["x-quicedge-backend"] == netloc(a)
                        gold = {"authorization": "Bearer sk-gold"}
                        r = await http.post("/v1/chat/completions", json=chat("beta"), headers=gold)
                        assert r.status_code == 200, r.text
                        assert r.headers["x-quicedge-backend"] == netloc(b)
                        bronze = await http.post("/v1/chat/completions", json=chat("beta"))
                        assert bronze.status_code == 503, bronze.text
                        assert bronze.json()["error"]["code"] == "tier_not_served"
                        assert gb.requests == 1  # the gold one only
                    breakers = edge.wiring.breakers
                    assert breakers is not None
                    assert breakers.state_of("gamma@v7", "bronze", "h200") == "closed"
                    assert breakers.state_of("beta", "gold", "a100") == "closed"
                    assert breakers.state_of("beta", "bronze", "a100") is None


async def test_a_labelled_backend_url_stays_when_discovery_runs_beside_it() -> None:
    """A `--backend` URL with labels beside a discovery mode is kept for good (it is compared
    by its URL, not by its labels), and a discovered one keeps its labels."""
    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.2"])
        config = dns_config(server, "sglang.fleet.test:30000#tiers=gold")
        discovery = Discovery(config, DnsSource(config))
        static = ["http://127.0.0.1:30000/#model=m&hardware=h100"]
        urls = await discovery.initial(static)
        assert urls == [
            "http://127.0.0.1:30000#model=m&hardware=h100",
            "http://127.0.0.2:30000#tiers=gold",
        ]
        registry = BackendRegistry(urls, pool=None)
        await discovery.refresh(registry)
    assert not any(b.draining for b in registry.backends)
    labels = {b.url: b.labels for b in registry.backends}
    assert labels == {
        "http://127.0.0.1:30000": {"model": "m", "hardware": "h100"},
        "http://127.0.0.2:30000": {"tiers": "gold"},
    }


async def test_a_reloaded_backend_list_changes_beside_what_discovery_finds() -> None:
    """`Wiring.set_backends` with discovery on: the listed URL that went drains, the new one
    joins, and what DNS finds stays."""
    with dns_server() as (zone, server):
        zone.set("sglang.fleet.test", "A", ["127.0.0.2"])
        config = dns_config(server, "sglang.fleet.test:30000")
        wiring = await build(
            fast_config(["http://127.0.0.1:30000"]), registry=CollectorRegistry(),
            discovery=config,
        )  # fmt: skip
        try:
            await wiring.set_backends(["http://127.0.0.3:30000"], drain_timeout=0.0)
            await wait_until(
                lambda: (
                    {b.url for b in wiring.registry.backends}
                    == {"http://127.0.0.2:30000", "http://127.0.0.3:30000"}
                )
            )
        finally:
            await wiring.aclose()
