"""Which secret values the Kubernetes manifests themselves carry: none in the production
overlay."""

from __future__ import annotations

from tests.deploy.test_manifests import one, render


def test_the_production_overlay_carries_no_secret_values() -> None:
    """`kubectl apply -k` writes every field a manifest holds: a Secret in the rendered gpu
    overlay would overwrite, on each apply (every config change), the ticket secret, Retry
    secret, admin token and certificate the operator made, with values published in this
    repository, which the edge takes as they are (whoever holds the ticket secret opens every
    ticket, and reads the 0-RTT data resumed with it). The operator makes the Secrets; the
    edge pods wait for them."""
    docs = render("gpu")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == []
    spec = one(docs, "Deployment", "quicedge")["spec"]["template"]["spec"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for c in spec["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    refs |= {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert refs == {"quicedge-secrets", "quicedge-tls"}
