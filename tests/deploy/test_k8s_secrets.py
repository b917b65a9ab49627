"""Which secret values the Kubernetes manifests themselves carry: none in the production
overlay."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge import serve
from tests.deploy.test_manifests import (
    OVERLAYS,
    config_toml,
    edge_args,
    mounted_secret,
    one,
    parse_serve,
    render,
    secret_values,
)


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_edge_reads_its_secrets_from_the_environment_not_its_command_line(
    overlay: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process's arguments are world-readable (`/proc/PID/cmdline`: `ps` in the pod, and on
    the node for any process of the host's PID namespace); its environment is its own user's.
    `$(VAR)` in `args` puts the value there: the settings loader reads every secret from its
    `QUICEDGE_*` variable as it is."""
    docs = render(overlay)
    args, env = edge_args(docs)
    values = set(secret_values(docs).values())
    assert not [a for a in args if any(v in a for v in values)]
    parsed = serve.build_parser().parse_args(args[1:])
    doc = config_toml(docs, parsed)
    doc["proxy"]["admin_token_file"] = mounted_secret(
        docs, doc["proxy"]["admin_token_file"], tmp_path
    )
    _, transport, _, _ = parse_serve(args, doc, env, monkeypatch)
    secrets = secret_values(docs)
    assert transport.ticket_secret == secrets[("quicedge-secrets", "ticket-secret")]
    assert transport.quic_retry_secret == secrets[("quicedge-secrets", "quic-retry-secret")]
