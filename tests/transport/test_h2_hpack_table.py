"""The HPACK table the TLS listener's HTTP/2 encoder keeps for a connection stays at 4 KiB
whatever the client advertises (RFC 7541 §4.2: an encoder may use less than the decoder's
maximum). A raw h2 client over TLS to the real listener; its decoder's table mirrors the
listener's encoder's."""

from __future__ import annotations

import itertools

from h2.settings import SettingCodes

from certs import DevCertificates
from tests.transport.test_request_cap import _Client, _serving
from transport.asgi import Receive, Scope, Send
from transport.tls import TlsMaterial

_ids = itertools.count()


async def _unique_headers(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with a header whose value no other answer has, as the edge's `x-request-id`."""
    if scope["type"] != "http":
        return
    headers = [(b"x-id", b"%032x" % next(_ids))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": scope["path"].encode() * 1000})


async def test_the_response_header_table_stays_4_kib_when_the_client_advertises_more(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """A client's SETTINGS_HEADER_TABLE_SIZE of 1 GiB made h2's encoder keep every answer's
    unique headers for the connection's life: ~70 bytes an answer, without bound."""
    listener = await _serving(tls, _unique_headers, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        client.conn.update_settings({SettingCodes.HEADER_TABLE_SIZE: 1 << 30})
        for batch in range(4):
            streams = [client.get(f"/{batch}-{i}") for i in range(50)]
            await client.until_done(*streams)
            assert all(client.whole(s) for s in streams)
        table = client.conn.decoder.header_table
        kept = sum(32 + len(name) + len(value) for name, value in table.dynamic_entries)
        assert table.maxsize <= 4096 and kept <= 4096
        assert client.goaways == []
    finally:
        await listener.stop()
