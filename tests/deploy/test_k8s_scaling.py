"""The edge's scale-out on Kubernetes, offline: who owns the replica count, and how many edge
pods a voluntary disruption may take at once at every size the autoscaler may choose."""

from __future__ import annotations

import math
from typing import Any

from tests.deploy.test_manifests import OVERLAYS, one, render


def disruptions_allowed(pdb: dict[str, Any], replicas: int) -> int:
    """What the disruption controller lets evictions take of `replicas` healthy pods
    (policy/v1: an integer or a percentage, rounded up, of minAvailable or maxUnavailable)."""

    def count(value: int | str) -> int:
        if isinstance(value, str):
            return math.ceil(replicas * int(value.rstrip("%")) / 100)
        return value

    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        return max(0, count(spec["maxUnavailable"]))
    return max(0, replicas - count(spec["minAvailable"]))


def test_the_autoscaler_owns_the_edge_replica_count() -> None:
    """`kubectl apply` sets every field its manifest holds: with `replicas` in the Deployment,
    each apply (every config change rolls out this way) puts the fleet back at that count,
    killing the pods the autoscaler had added with their QUIC connections, until the HPA
    scales up again. Kubernetes' advice: leave `replicas` out of a Deployment an HPA scales."""
    for overlay in OVERLAYS:
        docs = render(overlay)
        hpa = one(docs, "HorizontalPodAutoscaler", "quicedge")
        target = one(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"], overlay


def test_a_voluntary_disruption_takes_one_edge_pod_at_a_time_at_any_scale() -> None:
    """A node drain or cluster upgrade evicts as many pods at once as the budget allows: each
    takes its QUIC connections with it and leaves its load to the others. At the 20 pods the
    load asked for, `minAvailable: 1` let 19 go at once."""
    docs = render("cpu")
    hpa = one(docs, "HorizontalPodAutoscaler", "quicedge")
    pdb = one(docs, "PodDisruptionBudget", "quicedge")
    for replicas in range(hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"] + 1):
        assert disruptions_allowed(pdb, replicas) == 1, replicas


def test_the_disruption_arithmetic() -> None:
    def pdb(**spec: Any) -> dict[str, Any]:
        return {"spec": spec}

    assert disruptions_allowed(pdb(minAvailable=1), 20) == 19
    assert disruptions_allowed(pdb(minAvailable="50%"), 5) == 2
    assert disruptions_allowed(pdb(maxUnavailable=1), 20) == 1
    assert disruptions_allowed(pdb(maxUnavailable="10%"), 20) == 2


def test_the_edge_pods_spread_over_the_nodes() -> None:
    """With `externalTrafficPolicy: Local` the load balancer shares the traffic out by node, and
    each node's share goes to the edge pods on it: two pods on one node take half as much each
    as a pod alone on another, and one node's failure takes both of the two the HPA keeps at
    least. The scheduler's default spreading tolerates a skew of 3 pods per node."""
    for overlay in OVERLAYS:
        spec = one(render(overlay), "Deployment", "quicedge")["spec"]["template"]
        labels = spec["metadata"]["labels"]
        spreads = [
            c
            for c in spec["spec"].get("topologySpreadConstraints", [])
            if c["topologyKey"] == "kubernetes.io/hostname"
        ]
        assert len(spreads) == 1, overlay
        (spread,) = spreads
        assert spread["maxSkew"] == 1
        assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
        # More pods than nodes must still be scheduled: the HPA may ask for 20.
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
