"""`tools.h3_handshake_cpu`: full and 0-RTT handshakes against the H3 listener, CPU by layer."""

from __future__ import annotations

import re

import aioquic
import cryptography
import pytest

import transport.h3_server
from tools import h3_handshake_cpu


def test_modules_fall_into_their_layers() -> None:
    aioquic_root = aioquic.__file__.rsplit("/", 1)[0]
    layer = h3_handshake_cpu.layer_of
    assert layer(f"{aioquic_root}/tls.py") == "TLS messages"
    assert layer(f"{cryptography.__file__.rsplit('/', 1)[0]}/x509/base.py") == "TLS messages"
    assert layer(f"{aioquic_root}/quic/crypto.py") == "packet protection"
    assert layer(f"{aioquic_root}/_crypto.py") == "packet protection"
    assert layer(f"{aioquic_root}/quic/packet_builder.py") == "packet building"
    assert layer(f"{aioquic_root}/quic/connection.py") == "QUIC connection"
    assert layer(f"{aioquic_root}/h3/connection.py") == "H3"
    assert layer(f"{aioquic_root}/asyncio/protocol.py") == "event loop"
    assert layer(transport.h3_server.__file__) == "quicedge transport"
    assert layer(h3_handshake_cpu.__file__.replace("tools/h3_handshake_cpu", "transport/demo")) == (
        "the app"
    )


def test_a_small_run_reports_both_kinds_by_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert h3_handshake_cpu.main(["--connections", "3", "--top", "2"]) == 0
    printed = capsys.readouterr().out
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^(full|0-RTT)\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+(\d+)$", printed, re.M)
    }
    assert rows["full"][:2] == ("3", "0")
    assert rows["0-RTT"][:2] == ("3", "3")  # each resumption redeemed the previous ticket
    for _conns, _early, cpu_ms, per_core in rows.values():
        assert float(cpu_ms) > 0 and int(per_core) > 0
    for kind in ("full", "0-RTT"):
        section = printed.split(f"\n{kind}: by layer", 1)[1].split("top 2 functions", 1)[0]
        layers = dict(re.findall(r"^  (\S.*?)\s+([\d.]+) %", section, re.M))
        assert {"TLS messages", "QUIC connection", "packet building", "H3"} <= set(layers)
        assert 99.0 <= sum(float(v) for v in layers.values()) <= 101.0
