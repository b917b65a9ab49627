"""Files `quicedge request` and `quicedge bench` are given, tried before the first request:
a `--ticket` FILE that cannot be written (the request was sent, its answer printed, and then
saving the ticket ended the command with a traceback), a `--cacert` that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.conftest import run_command
from tests.helpers import free_udp_port


async def test_a_ticket_file_that_cannot_be_written_is_refused_before_the_request(
    tmp_path: Path,
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    ticket = a_file / "ticket"
    done = await run_command(
        "bench.request", f"https://127.0.0.1:{free_udp_port()}/v1/chat/completions", "--h3",
        "--json", "{}", "--timeout", "5", "--ticket", str(ticket),
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""  # no request was sent
    assert done.stderr.splitlines()[-1] == (
        f"quicedge request: error: --ticket {ticket}: Not a directory"
    ), done.stderr


@pytest.mark.parametrize("transport", ["h3", "h2"])
async def test_a_cacert_that_is_not_a_certificate_file_is_refused_before_the_request(
    tmp_path: Path, transport: str
) -> None:
    """A missing `--cacert` ended h2 and h1 with a traceback, and made h3 wait out the whole
    `--timeout` after its traceback; a file that is not PEM failed the h3 handshake as if the
    server had closed it."""
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    port = free_udp_port()
    for cacert, reason in ((tmp_path / "gone.pem", "No such file or directory"),
                           (not_pem, "not a PEM certificate file")):  # fmt: skip
        done = await run_command(
            "bench.request", f"https://127.0.0.1:{port}/v1/chat/completions", f"--{transport}",
            "--json", "{}", "--timeout", "20", "--cacert", str(cacert), timeout=15,
        )  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert done.stderr.splitlines()[-1] == (
            f"quicedge request: error: --cacert {cacert}: {reason}"
        ), done.stderr


async def test_bench_refuses_a_cacert_it_cannot_read_before_the_run(tmp_path: Path) -> None:
    cacert = tmp_path / "gone.pem"
    done = await run_command(
        "bench.cli", "--url", f"https://127.0.0.1:{free_udp_port()}/v1/chat/completions",
        "--num", "1", "--warmup", "0", "--timeout", "20", "--cacert", str(cacert), timeout=15,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.splitlines()[-1] == (
        f"quicedge bench: error: --cacert {cacert}: No such file or directory"
    ), done.stderr


async def test_relay_refuses_a_report_it_cannot_write_before_the_self_test(tmp_path: Path) -> None:
    """`quicedge bench relay --selftest --report FILE` ran the whole self-test, printed it, and
    then ended with a traceback where FILE could not be written."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    report = a_file / "relay.json"
    done = await run_command(
        "edge.cli", "bench", "relay", "--selftest", "--pings", "2", "--rtt-ms", "1",
        "--report", str(report), timeout=30,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""  # no self-test was run
    assert done.stderr.splitlines()[-1] == (
        f"quicedge bench relay: error: --report {report}: Not a directory"
    ), done.stderr
