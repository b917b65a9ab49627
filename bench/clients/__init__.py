"""Streaming request clients, one per transport, with the same interface and the same timings."""

from __future__ import annotations

from bench.clients.base import TRANSPORTS, Client, ClientError, ClientOptions, Target
from bench.clients.h1 import H1Client
from bench.clients.h2 import H2Client
from bench.clients.h3 import H3Client, TicketStore


def make_client(
    transport: str, options: ClientOptions, *, tickets: TicketStore | None = None
) -> Client:
    """A client for `transport` ("h3", "h2" or "h1")."""
    if options.zero_rtt and transport != "h3":
        raise ClientError("0-RTT needs --transport h3 (TLS over TCP has no early data here)")
    if transport == "h3":
        return H3Client(options, tickets=tickets)
    if transport == "h2":
        return H2Client(options)
    if transport == "h1":
        return H1Client(options)
    raise ClientError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


__all__ = [
    "TRANSPORTS",
    "Client",
    "ClientError",
    "ClientOptions",
    "H1Client",
    "H2Client",
    "H3Client",
    "Target",
    "TicketStore",
    "make_client",
]
