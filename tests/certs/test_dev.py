import ipaddress
import ssl

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
