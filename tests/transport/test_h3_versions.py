"""QUIC versions on the HTTP/3 listener: each connection is set up for its Initial's version
only (no Initial keys for versions it will not use), and a client that starts in QUIC v2 is
still served in v2."""

from __future__ import annotations

from typing import Any

import pytest
from aioquic.asyncio.client import connect
from aioquic.quic.packet import QuicProtocolVersion

from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, client_config, h3_connect
from transport.aioquic_private import server_configuration
from transport.h3_server import H3Server, _Endpoint

V1, V2 = QuicProtocolVersion.VERSION_1, QuicProtocolVersion.VERSION_2


def server_connection(server: H3Server) -> Any:
    (protocol,) = server.connections()
    return protocol._connection


@pytest.mark.parametrize("max_connections", [0, 100], ids=["no-cap", "capped"])
async def test_a_v1_connection_derives_v1_keys_only(
    h3_server: H3Factory, dev_certs, max_connections: int
) -> None:
    async with h3_server(max_connections=max_connections) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            r = await client.fetch("GET", "/echo")
            assert r.status == 200
            quic = server_connection(server)
            assert quic._version == V1
            assert set(quic._cryptos_initial) == {V1}
            assert quic.configuration.supported_versions == [V1]
            # the listener itself still speaks both, for the next client
            endpoint = server._endpoint
            assert endpoint is not None
            assert server_configuration(endpoint).supported_versions == [V1, V2]


async def test_a_client_that_starts_in_v2_is_served_in_v2(h3_server: H3Factory, dev_certs) -> None:
    config = client_config(dev_certs.ca_cert)
    config.supported_versions = [V2]
    async with h3_server() as server:
        async with connect(
            "127.0.0.1", server.port, configuration=config, create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            r = await client.fetch("GET", "/echo")
            assert r.status == 200
            quic = server_connection(server)
            assert quic._version == V2
            assert set(quic._cryptos_initial) == {V2}
            assert client.quic._version == V2


def test_the_per_version_configuration_follows_a_new_base(tls) -> None:
    """A certificate reload swaps the listener's configuration: the next connection's
    per-version copy is made from the new one, with its certificate."""
    endpoint = _Endpoint.__new__(_Endpoint)
    endpoint._versioned = {}
    first = tls.quic_configuration(idle_timeout=5.0)
    second = tls.quic_configuration(idle_timeout=7.0)
    a = endpoint._version_only(first, V1)
    assert endpoint._version_only(first, V1) is a  # made once per base
    assert a.supported_versions == [V1] and a.idle_timeout == 5.0
    assert a.certificate is first.certificate and first.supported_versions == [V1, V2]
    b = endpoint._version_only(second, V1)
    assert b is not a and b.idle_timeout == 7.0 and b.certificate is second.certificate
