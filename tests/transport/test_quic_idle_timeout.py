"""The QUIC listener's idle timeout against the client's (RFC 9000 §10.1), over real sockets
with an aioquic client."""

from __future__ import annotations

import asyncio

from aioquic.asyncio.client import connect

from certs import DevCertificates
from tests.helpers import wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, client_config
from transport.h3_session import H3Limits


async def test_a_client_that_advertises_no_idle_timeout_gets_the_listeners(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """max_idle_timeout 0 means the client has none (§18.2): the listener's own applies, not a
    timeout of three probe timeouts (a fraction of a second on a near network)."""
    async with h3_server(limits=H3Limits(idle_timeout=30)) as server:
        config = client_config(dev_certs.ca_cert)
        config.idle_timeout = 0.0
        async with connect(
            "127.0.0.1", server.port, configuration=config, create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            # Sent in the handshake's transport parameters; the client keeps its own timer
            # from the listener's 30 s from now on.
            client.quic.configuration.idle_timeout = 30.0
            assert (await client.fetch("GET", "/echo")).status == 200
            await wait_until(lambda: bool(server.connections()))
            quic = server.connections()[0].quic
            # Quiet for longer than three probe timeouts of this connection.
            await asyncio.sleep(3 * quic._loss.get_probe_timeout() + 0.3)
            assert server.connections(), "the listener dropped an idle connection early"
            assert (await client.fetch("GET", "/echo", timeout=5)).status == 200
            assert client.terminated is None


async def test_a_client_with_a_shorter_idle_timeout_has_its_connection_dropped_at_it(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """The smaller of the two applies where both have one (§10.1): the listener forgets the
    connection when its client does, not 30 s later."""
    async with h3_server(limits=H3Limits(idle_timeout=30)) as server:
        config = client_config(dev_certs.ca_cert)
        config.idle_timeout = 0.5
        async with connect(
            "127.0.0.1", server.port, configuration=config, create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            assert (await client.fetch("GET", "/echo")).status == 200
            await wait_until(lambda: not server.connections(), timeout=5)
