"""Who may open a connection to which pod of the Kubernetes manifests: NetworkPolicy semantics
evaluated offline on the rendered overlays."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.deploy.test_manifests import OVERLAYS, one, render

NAMESPACE = "quicedge"
MONITORING = "monitoring"
"""Where the Prometheus that scrapes the pods runs (deploy/k8s/monitoring/)."""


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


@dataclass(frozen=True)
class Source:
    """Where a connection comes from: a pod (its labels, its namespace's labels) or, with
    `address`, a client outside the cluster (the LoadBalancer keeps its address:
    externalTrafficPolicy Local)."""

    labels: dict[str, str] = field(default_factory=dict)
    namespace: str = NAMESPACE
    address: str | None = None

    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector applied to `labels` (an empty selector selects everything)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], source: Source) -> bool:
    if "ipBlock" in peer:
        if source.address is None:
            return False  # pod addresses in ipBlocks are implementation-defined: not counted on
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.address)
        if address not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(address in ipaddress.ip_network(c) for c in block.get("except", []))
    if source.address is not None:
        return False
    pods = peer.get("podSelector")
    namespaces = peer.get("namespaceSelector")
    if namespaces is None and source.namespace != NAMESPACE:
        return False  # a podSelector alone selects pods of the policy's namespace
    if namespaces is not None and not selects(namespaces, source.namespace_labels()):
        return False
    return pods is None or selects(pods, source.labels)


def port_matches(rule_port: dict[str, Any], pod: dict[str, Any], port: int, proto: str) -> bool:
    if rule_port.get("protocol", "TCP") != proto:
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):  # a named port of the destination pod
        named = {
            (p["name"], p.get("protocol", "TCP")): p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        return named.get((wanted, proto)) == port
    return bool(wanted <= port <= rule_port.get("endPort", wanted))


def reaches(docs: list[dict[str, Any]], source: Source, deployment: str, port: int,
            proto: str = "TCP") -> bool:  # fmt: skip
    """Whether a NetworkPolicy-enforcing cluster lets `source` open `port` on the pods of
    `deployment` (Kubernetes' semantics: a pod no Ingress policy selects takes everything; one
    that some select takes what any rule of any of them allows)."""
    pod = one(docs, "Deployment", deployment)["spec"]["template"]
    labels = pod["metadata"]["labels"]
    policies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and selects(d["spec"]["podSelector"], labels)
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers and not any(peer_admits(p, source) for p in peers):
                continue
            ports = rule.get("ports")
            if ports and not any(port_matches(p, pod, port, proto) for p in ports):
                continue
            return True
    return False


EDGE = Source({"app.kubernetes.io/name": "quicedge", "app.kubernetes.io/part-of": "quicedge"})
NEIGHBOUR = Source({"app.kubernetes.io/name": "something-else"})
"""Another workload's pod in the same namespace."""
ELSEWHERE = Source({"app": "web"}, namespace="default")
"""Any pod of another namespace: another team's, or one an attacker got into."""
PROMETHEUS = Source({"app.kubernetes.io/name": "prometheus"}, namespace=MONITORING)
CLIENT = Source(address="203.0.113.7")


def test_redis_and_the_backends_take_connections_only_from_the_edge(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Redis has no password: whoever reaches it can drain every backend of the fleet
    (`HSET quicedge:drains`, bypassing the admin token), or write a used 0-RTT ticket back
    (GETDEL is its replay protection). The backends serve anyone the inference API without the
    edge's tenants, quotas and rate limits."""
    _, docs = rendered
    for source in (NEIGHBOUR, ELSEWHERE, PROMETHEUS, CLIENT):
        assert not reaches(docs, source, "redis", 6379), source
    assert reaches(docs, EDGE, "redis", 6379)
    for source in (NEIGHBOUR, ELSEWHERE, CLIENT):
        assert not reaches(docs, source, "sglang", 30000), source
    assert reaches(docs, EDGE, "sglang", 30000)
    assert reaches(docs, EDGE, "sglang", 5557)  # KV-cache events ([kv_events], docs/routing.md)
    assert not reaches(docs, PROMETHEUS, "sglang", 5557)
    assert reaches(docs, PROMETHEUS, "sglang", 30000)  # its /metrics


def test_the_admin_port_takes_connections_only_from_prometheus(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Its reads (tenants, quotas, backends) have no token; the public listeners take anyone,
    over UDP and TCP."""
    _, docs = rendered
    for source in (NEIGHBOUR, ELSEWHERE, CLIENT):
        assert not reaches(docs, source, "quicedge", 9901), source
    assert reaches(docs, PROMETHEUS, "quicedge", 9901)
    for source in (CLIENT, NEIGHBOUR, ELSEWHERE, PROMETHEUS):
        assert reaches(docs, source, "quicedge", 4433, "UDP"), source
        assert reaches(docs, source, "quicedge", 8443, "TCP"), source
        assert not reaches(docs, source, "quicedge", 4433, "TCP"), source


def test_the_policy_evaluator_reads_policies_as_kubernetes_does() -> None:
    docs: list[dict[str, Any]] = [
        {"kind": "Deployment", "metadata": {"name": "db"}, "spec": {"template": {
            "metadata": {"labels": {"app": "db"}},
            "spec": {"containers": [{"ports": [{"name": "pg", "containerPort": 5432}]}]}}}},
    ]  # fmt: skip
    assert reaches(docs, ELSEWHERE, "db", 5432)  # no policy: open
    docs.append({"kind": "NetworkPolicy", "metadata": {"name": "db"}, "spec": {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                     "ports": [{"port": "pg"}]}]}})  # fmt: skip
    assert not reaches(docs, ELSEWHERE, "db", 5432)  # another namespace's "web"
    assert reaches(docs, Source({"app": "web"}), "db", 5432)
    assert not reaches(docs, Source({"app": "web"}), "db", 5433)
    assert not reaches(docs, Source({"app": "web"}), "db", 5432, "UDP")
