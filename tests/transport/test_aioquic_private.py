"""The installed aioquic still has every private attribute `transport.aioquic_private` uses.

An aioquic upgrade that renames or drops one fails here, by name, instead of in a request.
"""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, H3Connection, H3Stream
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketRecovery
from aioquic.quic.retry import QuicRetryTokenHandler
from aioquic.quic.stream import QuicStream, QuicStreamSender
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from packaging.requirements import Requirement

from transport import aioquic_private as private
from transport.h3_connection import StreamConfinedH3Connection

REPO = Path(__file__).resolve().parents[2]


def _client() -> QuicConnection:
    return QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN))


async def test_every_listed_attribute_exists_on_the_installed_aioquic() -> None:
    quic = _client()
    configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    samples: dict[type, object] = {
        QuicConnection: quic,
        QuicStream: QuicStream(stream_id=0),
        QuicStreamSender: QuicStreamSender(stream_id=0, writable=True),
        QuicConnectionProtocol: QuicConnectionProtocol(quic),
        QuicServer: QuicServer(configuration=configuration, retry=True),
        QuicRetryTokenHandler: QuicRetryTokenHandler(),
        H3Connection: H3Connection(_client()),
        H3Stream: H3Stream(0),
        QuicPacketRecovery: quic._loss,
        QuicPacketBuilder: QuicPacketBuilder(
            host_cid=b"",
            peer_cid=b"",
            version=quic.configuration.supported_versions[0],
            is_client=True,
            max_datagram_size=quic.configuration.max_datagram_size,
        ),
    }
    missing = [
        f"{entry.owner.__module__}.{entry.owner.__qualname__}.{entry.name}"
        for entry in private.ATTRIBUTES
        if not hasattr(samples[entry.owner], entry.name)
    ]
    assert not missing, f"aioquic {version('aioquic')} lacks {missing}"
    limit = quic._local_max_streams_bidi  # the one object whose fields are written
    assert hasattr(limit, "value") and hasattr(limit, "sent")


def test_every_entry_says_what_would_replace_it() -> None:
    assert all(entry.upstream.strip() for entry in private.ATTRIBUTES)
    names = [(entry.owner, entry.name) for entry in private.ATTRIBUTES]
    assert len(names) == len(set(names))


def test_the_overridden_h3_hooks_keep_their_names_and_parameters() -> None:
    overridden = {
        name
        for name in vars(StreamConfinedH3Connection)
        if name.startswith("_") and not name.startswith("__") and hasattr(H3Connection, name)
    }
    # Every private H3Connection method the subclass overrides is listed, and only those.
    assert overridden == set(private.H3_HOOK_PARAMETERS)
    listed = {entry.name for entry in private.ATTRIBUTES if entry.owner is H3Connection}
    assert overridden <= listed
    for name, parameters in private.H3_HOOK_PARAMETERS.items():
        assert tuple(inspect.signature(getattr(H3Connection, name)).parameters) == parameters


def test_the_stream_and_h3_helpers_work_on_real_objects() -> None:
    quic = _client()
    stream_id = quic.get_next_available_stream_id()
    assert private.unacked_bytes(quic, stream_id) == 0  # no such stream yet
    quic.send_stream_data(stream_id, b"abc")
    assert private.unacked_bytes(quic, stream_id) == 3
    assert private.retry_count(quic) == 0

    h3 = H3Connection(_client())
    assert isinstance(private.local_control_stream_id(h3), int)
    assert private.h3_stream(h3, 0) is None
    h3.send_headers(0, [(b":method", b"GET"), (b":scheme", b"https"),
                        (b":authority", b"localhost"), (b":path", b"/")])  # fmt: skip
    stream = private.h3_stream(h3, 0)
    assert stream is not None and stream.stream_id == 0
    private.forget_h3_stream(h3, 0)
    assert private.h3_stream(h3, 0) is None


async def test_the_server_helpers_work_on_a_real_server() -> None:
    first = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    server = QuicServer(configuration=first, retry=True)
    assert private.server_configuration(server) is first
    second = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    private.set_server_configuration(server, second)
    assert private.server_configuration(server) is second
    assert private.server_protocols(server) == []
    assert not private.has_connection(server, b"12345678")
    handler = QuicRetryTokenHandler()
    private.set_retry_handler(server, handler)
    assert server._retry is handler


def test_a_retry_key_set_through_the_helper_seals_the_tokens() -> None:
    key = AESGCM.generate_key(bit_length=128)
    minted, checker = QuicRetryTokenHandler(), QuicRetryTokenHandler()
    for handler in (minted, checker):
        private.set_retry_key(handler, AESGCM(key))
    address = ("127.0.0.1", 4433)
    token = minted.create_token(
        address=address, original_destination_connection_id=b"odcid123",
        retry_source_connection_id=b"rscid123", now=0.0,
    )  # fmt: skip
    checked = checker.validate_token(address=address, destination_cid=b"rscid123", token=token,
                                     now=1.0)  # fmt: skip
    assert checked == b"odcid123"
    with pytest.raises(ValueError):
        QuicRetryTokenHandler().validate_token(
            address=address, destination_cid=b"rscid123", token=token, now=1.0
        )


def test_the_aioquic_pin_is_one_minor_and_admits_the_installed_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [pin] = [Requirement(d) for d in project["dependencies"] if d.startswith("aioquic")]
    bounds = {spec.operator: spec.version for spec in pin.specifier}
    assert set(bounds) == {">=", "<"}
    low, high = (tuple(int(x) for x in bounds[op].split(".")[:2]) for op in (">=", "<"))
    assert high == (low[0], low[1] + 1), f"{pin}: the private attributes hold for one minor"
    assert pin.specifier.contains(version("aioquic"))
