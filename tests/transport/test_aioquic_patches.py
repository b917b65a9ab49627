"""`transport.aioquic_patches` applies on the installed aioquic and keeps its behaviour (the real
QUIC suites run with it in force: every handshake there verifies the pre-encoded chain)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import connection as quic_connection
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from certs import DevCertificates
from transport import aioquic_patches as patches
from transport import aioquic_private as private
from transport.tls import CertificateFiles, TlsMaterial


def test_every_change_is_in_force_in_a_process_that_imports_the_transport() -> None:
    assert patches.APPLIED == {
        "epochs_memoized": True,
        "epoch_identity_hash": True,
        "tls_framing": True,
        "connection_ids_bounded": True,
        "pacing_by_bytes": True,
        "new_token": True,
        "stateless_reset": True,
        "windows_by_delivered_bytes": True,
        "crypto_buffer_bounded": True,
        "idle_timeout_zero_is_none": True,
    }
    for name, replacement in patches.FRAMING.items():
        assert getattr(tls, name) is replacement


def test_every_patched_name_exists_on_the_installed_aioquic() -> None:
    for module, name, _how in private.PATCHED:
        owner: object = importlib.import_module(module)
        for part in name.split("."):
            owner = getattr(owner, part)
    # The certificate is encoded where the patch expects it: if aioquic stops calling
    # public_bytes on it, pre-encoding silently stops saving anything.
    source = inspect.getsource(tls.Context._server_handle_hello)
    assert "x.public_bytes(Encoding.DER)" in source
    assert "[self.certificate] + self.certificate_chain" in source
    # aioquic's issuing loop is the one the patch copies, with its own bound added.
    source = inspect.getsource(patches.ORIGINAL_REPLENISH)
    assert "while len(self._host_cids) < min(8, self._remote_active_connection_id_limit):" in source
    # The pacer is charged once per packet built, while that packet is the builder's current one.
    source = inspect.getsource(patches.ORIGINAL_WRITE_APPLICATION)
    assert source.count("self._loss._pacer.update_after_send(now=now)") == 1
    assert source.index("builder.start_packet(") < source.index("update_after_send")
    # aioquic's window rules read the offsets the patches show them, and nothing else does.
    source = inspect.getsource(patches.ORIGINAL_WRITE_STREAM_LIMITS)
    assert source.count("highest_offset") == 1
    assert "stream.receiver.highest_offset * 2 > stream.max_stream_data_local" in source
    source = inspect.getsource(patches.ORIGINAL_WRITE_CONNECTION_LIMITS)
    assert "max_data.used * 2 > max_data.value" in source
    assert "limit.sent - limit.used" in source and "limit is not max_data" in source
    # The crypto buffer's bound is the module's global, read when a CRYPTO frame arrives.
    assert quic_connection.MAX_PENDING_CRYPTO == patches.MAX_PENDING_CRYPTO == 16 * 1024
    source = inspect.getsource(quic_connection.QuicConnection._handle_crypto_frame)
    assert "if pending > MAX_PENDING_CRYPTO:" in source
    # HANDSHAKE_DONE is written once, into a packet in progress, and again only if lost.
    source = inspect.getsource(quic_connection.QuicConnection._on_handshake_done_delivery)
    assert "self._handshake_done_pending = True" in source


def test_memoized_epochs_are_the_same_sets_each_time() -> None:
    first = quic_connection.EPOCHS("IH01")
    assert quic_connection.EPOCHS("IH01") is first
    assert first == frozenset(tls.Epoch)
    assert quic_connection.EPOCHS("1") == {tls.Epoch.ONE_RTT}


def test_epochs_hash_by_identity_and_are_found_as_keys() -> None:
    for epoch in tls.Epoch:
        assert hash(epoch) == object.__hash__(epoch)
    table = {epoch: epoch.value for epoch in tls.Epoch}
    assert [table[e] for e in tls.Epoch] == [e.value for e in tls.Epoch]
    assert tls.Epoch.HANDSHAKE in quic_connection.EPOCHS("IH")
    assert tls.Epoch.ZERO_RTT not in quic_connection.EPOCHS("IH")


def test_the_guard_sees_a_container_that_holds_an_epoch() -> None:
    assert patches.epochs_hashed([{tls.Epoch.INITIAL: 1}])
    assert patches.epochs_hashed([{"a"}, frozenset({tls.Epoch.ONE_RTT})])
    assert not patches.epochs_hashed([{"a": tls.Epoch.INITIAL}, [tls.Epoch.INITIAL], {1, 2}])
    client = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    assert patches.epochs_hashed([quic_connection.QuicConnection(configuration=client)])


def test_pre_encoded_certificates_encode_once_and_delegate(dev_certs: DevCertificates) -> None:
    material = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
    config = material.quic_configuration(idle_timeout=5.0)
    plain = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    plain.load_cert_chain(dev_certs.cert, dev_certs.key)
    assert isinstance(config.certificate, patches.PreEncodedCertificate)
    chain = [config.certificate, *config.certificate_chain]
    expected = [plain.certificate, *plain.certificate_chain]
    assert [c.public_bytes(Encoding.DER) for c in chain] == [
        c.public_bytes(Encoding.DER) for c in expected
    ]
    assert config.certificate.public_bytes(Encoding.PEM) == plain.certificate.public_bytes(
        Encoding.PEM
    )
    assert config.certificate.subject == plain.certificate.subject
    assert config.certificate == plain.certificate
    assert isinstance(plain.certificate, x509.Certificate)
    again = patches.pre_encoded(config)
    assert again.certificate is config.certificate  # idempotent


class _Transcript:
    def __init__(self) -> None:
        self.hashed: list[bytes] = []

    def update_hash(self, data: bytes) -> None:
        self.hashed.append(data)


def _framed(framing: dict[str, Any], *, fail: bool = False) -> tuple[bytes, list[bytes]]:
    buf = Buffer(data=bytes(64))  # zeroed: a failed block leaves its length unwritten
    transcript = _Transcript()
    try:
        with framing["push_message"](transcript, buf):
            buf.push_uint8(1)
            with framing["push_block"](buf, 3):
                with framing["push_extension"](buf, 0x2B):
                    buf.push_bytes(b"abc")
                with framing["push_block"](buf, 1):
                    buf.push_bytes(b"xy")
                    if fail:
                        raise ValueError("the block failed")
    except ValueError:
        pass
    return buf.data, transcript.hashed


@pytest.mark.parametrize("fail", [False, True])
def test_tls_framing_writes_what_aioquics_own_writes(fail: bool) -> None:
    ours = _framed(patches.FRAMING, fail=fail)
    assert ours == _framed(patches.ORIGINAL_FRAMING, fail=fail)
    if not fail:
        assert ours[0] == bytes.fromhex("01 00000a 002b0003616263 02 7879".replace(" ", ""))
        assert ours[1] == [ours[0]]


@pytest.mark.parametrize("framing", [patches.FRAMING, patches.ORIGINAL_FRAMING])
def test_tls_framing_reads_blocks_and_refuses_trailing_bytes(framing: dict[str, Any]) -> None:
    buf = Buffer(data=bytes.fromhex("0003616263ff"))
    with framing["pull_block"](buf, 2) as length:
        assert (length, buf.pull_bytes(3)) == (3, b"abc")
    assert buf.pull_uint8() == 0xFF
    short = Buffer(data=bytes.fromhex("03616263"))
    with pytest.raises(tls.AlertDecodeError), framing["pull_block"](short, 1):
        short.pull_bytes(2)


@pytest.mark.parametrize(
    ("remote", "local", "issued"), [(8, 8, 8), (3, 8, 3), (12, 8, 8), (8, 4, 4), (2, 4, 2)]
)
def test_connection_ids_issued_are_bounded_by_both_limits(
    remote: int, local: int, issued: int
) -> None:
    def connection() -> quic_connection.QuicConnection:
        quic = quic_connection.QuicConnection(
            configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        )
        quic._remote_active_connection_id_limit = remote
        private.set_active_connection_id_limit(quic, local)
        return quic

    ours = connection()
    ours._replenish_connection_ids()
    assert len(ours._host_cids) == issued
    assert [c.sequence_number for c in ours._host_cids] == list(range(issued))
    assert len({c.cid for c in ours._host_cids}) == issued
    assert len({c.stateless_reset_token for c in ours._host_cids}) == issued
    if local == 8:  # aioquic's default: exactly what aioquic itself issues
        theirs = connection()
        patches.ORIGINAL_REPLENISH(theirs)
        assert len(theirs._host_cids) == issued
