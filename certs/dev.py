"""Make (or reuse) a development CA and a leaf certificate for localhost, 127.0.0.1 and ::1."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LEAF_NAMES: tuple[str, ...] = ("localhost",)
LEAF_ADDRESSES: tuple[str, ...] = ("127.0.0.1", "::1")
CA_LIFETIME = dt.timedelta(days=3650)
LEAF_LIFETIME = dt.timedelta(days=825)  # the longest leaf lifetime browsers have accepted
# Regenerate a little before expiry so a long-running stack never starts on a dying cert.
RENEW_MARGIN = dt.timedelta(days=7)


@dataclass(frozen=True, slots=True)
class DevCertificates:
    """Paths of a generated development PKI."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    cert: Path
    """Leaf certificate followed by the CA certificate (a full chain)."""
    key: Path


def default_dir() -> Path:
    """`$QUICEDGE_CERTS_DIR`, else `certs/dev/` beside this package (git-ignored)."""
    env = os.environ.get("QUICEDGE_CERTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "dev"


def _paths(directory: Path) -> DevCertificates:
    return DevCertificates(
        directory=directory,
        ca_cert=directory / "ca.pem",
        ca_key=directory / "ca-key.pem",
        cert=directory / "cert.pem",
        key=directory / "key.pem",
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _still_valid(paths: DevCertificates) -> bool:
    if not all(p.exists() for p in (paths.ca_cert, paths.ca_key, paths.cert, paths.key)):
        return False
    try:
        leaf = x509.load_pem_x509_certificate(paths.cert.read_bytes())
        ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    except ValueError:
        return False
    deadline = _now() + RENEW_MARGIN
    if leaf.not_valid_after_utc < deadline or ca.not_valid_after_utc < deadline:
        return False
    try:  # signed by this CA, not only named by it: every generated CA has the same name
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@contextlib.contextmanager
def _generating(directory: Path) -> Iterator[None]:
    """Held while one process checks and makes the PKI in `directory`: processes started
    together (workers, a test run's) would otherwise each make one, and a client could trust
    one's CA while the server presents another's leaf."""
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Whole or not at all: written beside `path`, then renamed over it."""
    part = path.with_name(path.name + ".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(part, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _make_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quicedge development CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    san = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in LEAF_NAMES]
        + [x509.IPAddress(ipaddress.ip_address(a)) for a in LEAF_ADDRESSES]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + LEAF_LIFETIME)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def dev_certificates_refusal(hosts: Iterable[str]) -> str | None:
    """Why the development certificates must not be served on `hosts`, or None when every host
    is loopback. Their CA key sits on this machine in a readable folder, so a listener other
    machines can reach would present a certificate anyone with that folder could forge."""
    exposed = sorted({h for h in hosts if not _is_loopback(h)})
    if not exposed:
        return None
    return (
        f"no --cert/--key, and {', '.join(exposed)} is not a loopback address: pass --cert and "
        "--key, or --dev-certs to serve the development certificates there anyway"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def ensure_dev_certificates(
    directory: Path | None = None, *, force: bool = False
) -> DevCertificates:
    """Return the development PKI in `directory`, generating it if missing, invalid or expiring."""
    paths = _paths(directory or default_dir())
    if not force and _still_valid(paths):
        return paths
    paths.directory.mkdir(parents=True, exist_ok=True)
    with _generating(paths.directory):
        if not force and _still_valid(paths):  # made by another process while this one waited
            return paths
        ca_cert, ca_key = _make_ca()
        leaf_cert, leaf_key = _make_leaf(ca_cert, ca_key)
        ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        _write(paths.ca_key, _key_pem(ca_key), 0o600)
        _write(paths.key, _key_pem(leaf_key), 0o600)
        _write(paths.ca_cert, ca_pem)
        _write(paths.cert, leaf_cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
    return paths
