"""TLS material for every listener: PEM certificate chain and key, reloadable on SIGHUP (or
when the files change, with `[serve] cert_poll_interval`).

One ``TlsMaterial`` serves both stacks: it builds a fresh ``QuicConfiguration`` for the QUIC
endpoint (each new connection takes the endpoint's current one) and keeps *one* ``ssl.SSLContext``
for hypercorn, whose ``load_cert_chain`` swaps the certificate for new handshakes in place.
Established connections keep the certificate they were set up with: a reload drops nothing.

With a key log file (`--tls-keylog FILE`), both stacks append every connection's TLS secrets to
it in the NSS key log format that Wireshark reads (the SSLKEYLOGFILE convention), so that a
packet capture of QUIC or TLS can be decrypted while debugging. Anyone who can read that file
can decrypt the traffic it covers: it is created readable by its owner only, and `serve` says
on start-up that it is on.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from transport.aioquic_patches import pre_encoded

log = logging.getLogger("quicedge.transport.tls")

TCP_ALPN = ["h2", "http/1.1"]
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""TLS 1.2's cipher suites: ECDHE with an AEAD cipher only. Python's default list also has the
CBC suites (`ECDHE-*-AES*-SHA256/384`), which RFC 9113 Appendix A bars from HTTP/2: a client
that offered only those got h2 over one, and a strict HTTP/2 client ends such a connection
(INADEQUATE_SECURITY). TLS 1.3's suites are all AEAD and set apart by OpenSSL."""


class TlsError(ValueError):
    """Certificate or key missing, unreadable or not matching."""


@dataclass(frozen=True, slots=True)
class CertificateFiles:
    cert: Path
    """PEM certificate chain, leaf first."""
    key: Path
    """PEM private key (unencrypted)."""


def resolve_files(cert: str | Path | None, key: str | Path | None) -> CertificateFiles:
    """``--cert``/``--key`` when both are given; the development certificates when neither is."""
    if (cert is None) != (key is None):
        raise TlsError("--cert and --key go together: give both or neither")
    if cert is None or key is None:
        from certs import ensure_dev_certificates

        dev = ensure_dev_certificates()
        return CertificateFiles(dev.cert, dev.key)
    return CertificateFiles(Path(cert), Path(key))


def check_files(files: CertificateFiles) -> float:
    """Parse both files and check the key matches the leaf; raise ``TlsError`` with the reason.
    Returns when the leaf expires (its notAfter, Unix seconds)."""
    try:
        chain = x509.load_pem_x509_certificates(files.cert.read_bytes())
    except OSError as exc:
        raise TlsError(f"cannot read certificate {files.cert}: {exc.strerror}") from None
    except ValueError as exc:
        raise TlsError(f"certificate {files.cert} is not PEM: {exc}") from None
    try:
        key = load_pem_private_key(files.key.read_bytes(), password=None)
    except OSError as exc:
        raise TlsError(f"cannot read key {files.key}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise TlsError(f"key {files.key} is not an unencrypted PEM private key: {exc}") from None
    if chain[0].public_key() != key.public_key():
        raise TlsError(f"key {files.key} does not match certificate {files.cert}")
    return chain[0].not_valid_after_utc.timestamp()


def open_keylog(path: Path) -> TextIO:
    """`path` opened for appending key log lines, one write each (it is made owner-only when
    created); OSError naming what is wrong."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return open(fd, "a", buffering=1, encoding="ascii")


class TlsMaterial:
    """The current certificate for all listeners, with reload and change notification."""

    def __init__(self, files: CertificateFiles, *, keylog: Path | None = None) -> None:
        self.expires_at = check_files(files)
        """When the certificate in use expires (Unix seconds)."""
        self.files = files
        self.keylog = keylog
        """Where both stacks append TLS secrets (None: nowhere)."""
        self._keylog_file: TextIO | None = open_keylog(keylog) if keylog is not None else None
        self._ssl: ssl.SSLContext | None = None
        self._listeners: list[Callable[[], None]] = []
        self.generation = 0
        """Bumped on each successful reload."""

    def quic_configuration(self, *, idle_timeout: float) -> QuicConfiguration:
        config = QuicConfiguration(
            is_client=False,
            alpn_protocols=H3_ALPN,
            idle_timeout=idle_timeout,
        )
        config.load_cert_chain(self.files.cert, self.files.key)
        config.secrets_log_file = self._keylog_file
        return pre_encoded(config)  # DER-encoded once, not at every full handshake

    def ssl_context(self) -> ssl.SSLContext:
        """The shared server context for TLS over TCP (ALPN h2, http/1.1; TLS >= 1.2, AEAD)."""
        if self._ssl is None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 §9.2
            ctx.options |= ssl.OP_NO_COMPRESSION  # RFC 9113 §9.2.1
            ctx.set_ciphers(TLS12_CIPHERS)  # RFC 9113 §9.2.2
            ctx.set_alpn_protocols(TCP_ALPN)
            # One TLS 1.3 session ticket, not OpenSSL's two: each costs ~35 µs in the handshake
            # step the client's first request waits behind, and a client resumes with one.
            ctx.num_tickets = 1
            ctx.load_cert_chain(self.files.cert, self.files.key)
            if self.keylog is not None:
                ctx.keylog_filename = str(self.keylog)
            self._ssl = ctx
        return self._ssl

    def on_reload(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def reload(self) -> bool:
        """Re-read the files; on any error keep serving the old certificate and return False."""
        try:
            expires_at = check_files(self.files)
            if self._ssl is not None:
                self._ssl.load_cert_chain(self.files.cert, self.files.key)
        except (TlsError, ssl.SSLError, OSError) as exc:
            log.error("TLS reload failed, keeping the current certificate: %s", exc)
            return False
        self.generation += 1
        self.expires_at = expires_at
        for callback in self._listeners:
            callback()
        log.info("TLS certificate reloaded from %s", self.files.cert)
        return True
