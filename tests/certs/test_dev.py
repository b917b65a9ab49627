import ipaddress
import multiprocessing
import pathlib
import ssl
import time

from cryptography import x509

from certs import ensure_dev_certificates
from certs.cli import main as certs_main


def test_generates_ca_and_localhost_leaf(tmp_path):
    paths = ensure_dev_certificates(tmp_path)
    leaf = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert paths.key.stat().st_mode & 0o777 == 0o600
    assert paths.ca_key.stat().st_mode & 0o777 == 0o600


def test_leaf_verifies_against_the_ca_with_stdlib_ssl(tmp_path):
    paths = ensure_dev_certificates(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(paths.cert, paths.key)
    client = ssl.create_default_context(cafile=str(paths.ca_cert))
    client_in, client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_in, server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(client_in, client_out, server_hostname="localhost")
    s = server.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
    assert c.version() == "TLSv1.3"


def test_reuses_valid_certificates_and_force_regenerates(tmp_path):
    first = ensure_dev_certificates(tmp_path)
    before = first.cert.read_bytes()
    assert ensure_dev_certificates(tmp_path).cert.read_bytes() == before
    assert ensure_dev_certificates(tmp_path, force=True).cert.read_bytes() != before


def test_corrupt_files_are_replaced(tmp_path):
    paths = ensure_dev_certificates(tmp_path)
    paths.cert.write_text("not a certificate")
    again = ensure_dev_certificates(tmp_path)
    x509.load_pem_x509_certificate(again.cert.read_bytes())


def test_cli_writes_into_out(tmp_path, capsys):
    assert certs_main(["--out", str(tmp_path / "x")]) == 0
    printed = capsys.readouterr().out
    for name in ("ca.pem", "cert.pem", "key.pem"):  # it says where each file is
        assert (tmp_path / "x" / name).exists()
        assert str(tmp_path / "x" / name) in printed


def test_a_leaf_of_another_ca_of_the_same_name_is_made_again(tmp_path):
    """Every development CA has the same name: a leaf from one run beside the CA of another
    passed the name check, and clients trusting that CA refused the server."""
    first = ensure_dev_certificates(tmp_path / "a")
    other = ensure_dev_certificates(tmp_path / "b")
    first.ca_cert.write_bytes(other.ca_cert.read_bytes())
    again = ensure_dev_certificates(first.directory)
    leaf = x509.load_pem_x509_certificate(again.cert.read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(again.ca_cert.read_bytes()))


def _make(directory: str, start: float, seen: str) -> None:
    time.sleep(max(0.0, start - time.time()))
    paths = ensure_dev_certificates(pathlib.Path(directory))
    pathlib.Path(seen).write_bytes(paths.ca_cert.read_bytes())  # the CA it would trust


def test_processes_started_together_make_one_pki(tmp_path):
    """Four processes that find no certificates at the same moment: one makes them, the
    others wait and use them. Each made its own before, and those that finished first
    trusted a CA the files no longer held."""
    ctx = multiprocessing.get_context("spawn")
    start = time.time() + 1.5  # after the spawned interpreters' imports
    pki = tmp_path / "pki"
    seen = [tmp_path / f"seen-{i}" for i in range(4)]
    procs = [ctx.Process(target=_make, args=(str(pki), start, str(s))) for s in seen]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    ca = (pki / "ca.pem").read_bytes()
    assert all(s.read_bytes() == ca for s in seen)
    leaf = x509.load_pem_x509_certificate((pki / "cert.pem").read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    assert [p.name for p in pki.iterdir() if p.name.endswith(".part")] == []
