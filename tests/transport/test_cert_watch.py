"""`[serve] cert_poll_interval`: a renewed certificate, mounted the way Kubernetes mounts a
Secret (a `..data` symlink swapped to a new directory), is served without a signal; a broken one
is refused and the old one stays. A real `quicedge serve`, real TLS handshakes."""

from __future__ import annotations

import asyncio
import shutil
import signal
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from certs import DevCertificates, ensure_dev_certificates
from tests.edge.test_config_reload import audit_events
from tests.edge.test_many_streams import stand_in  # noqa: F401  (the fixture)
from tests.transport.conftest import ServeProcess
from tests.transport.test_file_watch import swap_link

APPLIED = 'quicedge_tls_reloads_total{outcome="applied"}'
REFUSED = 'quicedge_tls_reloads_total{outcome="refused"}'
EXPIRY = "quicedge_tls_certificate_expiry_timestamp_seconds"


def mount(volume: Path, generation: str, cert: bytes, key: bytes) -> None:
    """Write one generation of the Secret and point `..data` at it."""
    directory = volume / generation
    directory.mkdir()
    (directory / "tls.crt").write_bytes(cert)
    (directory / "tls.key").write_bytes(key)
    swap_link(volume / "..data", Path(generation))


def not_after(pki: DevCertificates) -> float:
    return x509.load_pem_x509_certificate(pki.cert.read_bytes()).not_valid_after_utc.timestamp()


async def status(port: int, ca: Path) -> int:
    """A new TLS connection, trusting only `ca`."""
    ctx = ssl.create_default_context(cafile=str(ca))
    async with httpx.AsyncClient(verify=ctx, timeout=10) as client:
        return (await client.get(f"https://localhost:{port}/v1/models")).status_code


async def wait_metric(proc: ServeProcess, sample: str, at_least: float) -> None:
    await asyncio.to_thread(proc.wait_metric, sample, at_least, 30.0)


async def test_a_renewed_secret_is_served_without_a_signal(tmp_path: Path) -> None:
    old = ensure_dev_certificates(tmp_path / "old")
    new = ensure_dev_certificates(tmp_path / "new")
    volume = tmp_path / "tls"
    volume.mkdir()
    mount(volume, "..gen1", old.cert.read_bytes(), old.key.read_bytes())
    for name in ("tls.crt", "tls.key"):
        (volume / name).symlink_to(Path("..data") / name)
    proc = ServeProcess(
        "--demo", "--cert", str(volume / "tls.crt"), "--key", str(volume / "tls.key"),
        "--cert-poll-interval", "0.1",
    )  # fmt: skip
    try:
        assert proc.metric(EXPIRY) == pytest.approx(not_after(old))
        assert await status(proc.tcp_port, old.ca_cert) == 200

        mount(volume, "..gen2", new.cert.read_bytes(), new.key.read_bytes())
        await wait_metric(proc, APPLIED, 1)
        assert await status(proc.tcp_port, new.ca_cert) == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await status(proc.tcp_port, old.ca_cert)
        assert proc.metric(EXPIRY) == pytest.approx(not_after(new))

        # A renewal whose key does not match its certificate: refused, the current one stays.
        mount(volume, "..gen3", old.cert.read_bytes(), new.key.read_bytes())
        await wait_metric(proc, REFUSED, 1)
        assert await status(proc.tcp_port, new.ca_cert) == 200
        assert proc.metric(APPLIED) == 1
        assert proc.metric(EXPIRY) == pytest.approx(not_after(new))
    finally:
        assert proc.stop() == 0, proc.errors()
    assert "TLS reload failed, keeping the current certificate" in proc.errors()
    shutil.rmtree(volume)


async def test_certificate_reloads_are_lines_of_the_audit_chain(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    pki = ensure_dev_certificates(tmp_path / "pki")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki.cert, cert)
    shutil.copy(pki.key, key)
    audit = tmp_path / "audit.jsonl"
    proc = ServeProcess(
        "--backend", stand_in, "--cert", str(cert), "--key", str(key), "--audit-log", str(audit),
    )  # fmt: skip
    try:
        proc.proc.send_signal(signal.SIGHUP)
        await wait_metric(proc, APPLIED, 1)
        key.write_text("not a key")
        proc.proc.send_signal(signal.SIGHUP)
        await wait_metric(proc, REFUSED, 1)
    finally:
        assert proc.stop() == 0, proc.errors()
    reloads = [
        e for chain in audit_events(tmp_path, "audit.jsonl") for e in chain
        if e[0] == "certificate_reload"
    ]  # fmt: skip
    assert reloads == [("certificate_reload", "applied"), ("certificate_reload", "refused")]
