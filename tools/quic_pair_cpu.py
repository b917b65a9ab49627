"""CPU of aioquic itself per connection: a client and a server `QuicConnection` in one process,
their datagrams handed across in memory (no sockets, no event loop, no quicedge code), a full
handshake and one 200-byte request answered with 500 bytes. For comparing builds of aioquic
(docs/benchmarks.md, "Tried and not kept": compiled with mypyc), run once per build:

    python -m tools.quic_pair_cpu --connections 300
    PYTHONPATH=/path/to/other/aioquic/src python -m tools.quic_pair_cpu --connections 300
"""

from __future__ import annotations

import argparse
import datetime
import time

import aioquic
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CLIENT = ("10.0.0.1", 4433)
SERVER = ("10.0.0.2", 443)
TICK = 0.03
"""Seconds the shared clock moves when neither side has anything to send (fires ACK timers)."""


def configurations() -> tuple[QuicConfiguration, QuicConfiguration]:
    """(client, server) with a fresh P-256 certificate for `localhost`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    server = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
    server.certificate, server.private_key = cert, key
    client = QuicConfiguration(
        is_client=True, alpn_protocols=["h3"], server_name="localhost", verify_mode=0
    )
    return client, server


def exchange(client: QuicConnection, server: QuicConnection, now: float) -> float:
    """Hand datagrams across until both sides are quiet for a few ticks; the clock after."""
    for _ in range(6):
        moved = True
        while moved:
            moved = False
            for data, _ in client.datagrams_to_send(now=now):
                server.receive_datagram(data, CLIENT, now=now)
                moved = True
            for data, _ in server.datagrams_to_send(now=now):
                client.receive_datagram(data, SERVER, now=now)
                moved = True
        now += TICK
        for side in (client, server):
            timer = side.get_timer()
            if timer is not None and timer <= now:
                side.handle_timer(now=now)
    return now


def one_connection(client_config: QuicConfiguration, server_config: QuicConfiguration) -> None:
    """A full handshake, one request and its answer."""
    now = time.monotonic()
    client = QuicConnection(configuration=client_config)
    client.connect(SERVER, now=now)
    first = client.datagrams_to_send(now=now)
    server = QuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    for data, _ in first:
        server.receive_datagram(data, CLIENT, now=now)
    now = exchange(client, server, now)
    stream = client.get_next_available_stream_id()
    client.send_stream_data(stream, b"x" * 200, end_stream=True)
    now = exchange(client, server, now)
    answered = False
    while (event := server.next_event()) is not None:
        if isinstance(event, StreamDataReceived):
            server.send_stream_data(event.stream_id, b"y" * 500, end_stream=True)
            answered = True
    if not answered:
        raise RuntimeError("the request did not reach the server")
    exchange(client, server, now)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=300, help="measured (300)")
    parser.add_argument("--warmup", type=int, default=20, help="not measured (20)")
    args = parser.parse_args(argv)
    client, server = configurations()
    for _ in range(args.warmup):
        one_connection(client, server)
    start = time.process_time()
    for _ in range(args.connections):
        one_connection(client, server)
    per = (time.process_time() - start) / args.connections * 1000
    built = QuicConnection.__module__
    where = getattr(__import__(built, fromlist=["_"]), "__file__", "?")
    print(f"aioquic {aioquic.__version__} ({where}): {per:.2f} ms CPU per connection pair, "
          f"{args.connections} connections")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
