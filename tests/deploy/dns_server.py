"""A small authoritative DNS server (dnslib) on 127.0.0.1 whose records a test changes live."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar, cast

from dnslib import AAAA, QTYPE, RR, SRV, A, DNSLabel, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from tests.helpers import free_udp_port


class Zone(BaseResolver):  # type: ignore[misc]
    """Records by (name, type); a name with no record of any type answers NXDOMAIN."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], list[RR]] = {}

    def set(self, name: str, kind: str, values: list[object]) -> None:
        make = {"A": A, "AAAA": AAAA}
        rrs = []
        for value in values:
            if kind == "SRV":
                port, target = value  # type: ignore[misc]
                rdata = SRV(priority=0, weight=1, port=port, target=target)
            else:
                rdata = make[kind](value)
            rrs.append(RR(name, getattr(QTYPE, kind), rdata=rdata, ttl=1))
        with self._lock:
            if rrs:
                self._records[(str(DNSLabel(name)), kind)] = rrs
            else:
                self._records.pop((str(DNSLabel(name)), kind), None)

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name, kind = str(request.q.qname), QTYPE[request.q.qtype]
        with self._lock:
            rrs = self._records.get((name, kind))
            known = any(n == name for n, _ in self._records)
        if rrs:
            for rr in rrs:
                reply.add_answer(rr)
        elif not known:
            reply.header.rcode = 3  # NXDOMAIN
        return reply


Z = TypeVar("Z", bound=Zone)


@contextmanager
def dns_server(zone: Z | None = None) -> Iterator[tuple[Z, str]]:
    """(zone, "127.0.0.1:PORT") for as long as the block runs: `zone`, or a new `Zone`."""
    zone = zone if zone is not None else cast(Z, Zone())
    port = free_udp_port()
    quiet = DNSLogger(log="-recv,-send,-request,-reply,-truncated,-error,-data", prefix=False)
    server = DNSServer(zone, address="127.0.0.1", port=port, logger=quiet)
    server.start_thread()
    try:
        yield zone, f"127.0.0.1:{port}"
    finally:
        server.stop()
