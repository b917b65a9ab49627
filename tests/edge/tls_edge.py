"""The edge on its real TLS listener (`transport.tcp`: hypercorn, h2 and HTTP/1.1) in front of
stand-ins, for tests that need what `quicedge serve` runs rather than a bare hypercorn."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from certs.dev import DevCertificates
from edge.admission.settings import AdmissionSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.config import ProxyConfig
from edge.wiring import Wiring, build
from transport.tcp import TcpListener
from transport.tls import CertificateFiles, TlsMaterial


@dataclass
class TlsEdge:
    url: str
    """`https://localhost:PORT` (the development certificate names localhost)."""
    wiring: Wiring
    registry: CollectorRegistry
    ssl_context: ssl.SSLContext
    """Trusts the development CA."""


@contextlib.asynccontextmanager
async def tls_edge(
    config: ProxyConfig, certs: DevCertificates, **build_kwargs: object
) -> AsyncIterator[TlsEdge]:
    registry = CollectorRegistry()
    wiring = await build(config, registry=registry, **build_kwargs)  # type: ignore[arg-type]
    await wiring.start()
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    listener = TcpListener(wiring.app, host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        yield TlsEdge(f"https://localhost:{listener.port}", wiring, registry, ctx)
    finally:
        await listener.stop()
        await wiring.aclose()


def with_client_keys(config: ProxyConfig, *keys: str) -> ProxyConfig:
    """`config` with one tenant per API key: admission refuses a key it does not know, and
    clients such as the OpenAI SDK always send one."""
    tenants = [
        TenantSettings(name=f"client{i}", api_key_sha256=[key_digest(key)])
        for i, key in enumerate(keys)
    ]
    config.admission = AdmissionSettings(tenants=tenants)
    return config
