"""`tools.quic_pair_cpu`: a client and a server QUIC connection in one process complete their
handshake and one request, and the CPU per pair is printed."""

from __future__ import annotations

import pytest

from tools.quic_pair_cpu import configurations, main, one_connection


def test_a_pair_completes_a_handshake_and_a_request() -> None:
    client, server = configurations()
    one_connection(client, server)  # raises when the request does not reach the server


def test_it_prints_cpu_per_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--connections", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "ms CPU per connection pair, 3 connections" in out and "aioquic" in out
