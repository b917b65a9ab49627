"""`quicedge request` as a user runs it: over each transport, and resuming in 0-RTT."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bench.clients import TicketStore
from bench.clients.h3 import load_tickets
from bench.request import main as request_main
from bench.stub_app import WORDS
from certs import DevCertificates
from tests.bench.conftest import Servers, run_command
from tests.bench.servers import edge_h3
from tests.helpers import free_port
from transport.metrics import TransportMetrics

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "prompt_tokens": 5})


def _fields(stdout: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


@pytest.mark.parametrize("transport", ["h3", "h2", "h1"])
async def test_request_prints_stream_and_ttft(
    servers: Servers, dev_certs: DevCertificates, transport: str
) -> None:
    port = servers.h3_port if transport == "h3" else servers.tls_port
    url = f"https://localhost:{port}/v1/chat/completions"
    done = await run_command(
        "bench.request", url, "--json", CHAT, f"--{transport}", "--cacert", str(dev_certs.ca_cert)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("".join(WORDS) + "\n")
    fields = _fields(done.stdout)
    assert fields["status"] == "200"
    assert fields["transport"] == transport
    assert fields["backend"] == "stub"
    assert fields["early data"] == "not used"
    assert fields["ttft"].endswith(" ms") and float(fields["ttft"][:-3]) > 0
    assert fields["prompt tokens"] == "5 (cached 3)"


async def test_request_plain_http_defaults_to_h1(servers: Servers) -> None:
    url = f"http://127.0.0.1:{servers.plain_port}/v1/chat/completions"
    done = await run_command("bench.request", url, "--json", CHAT)
    assert done.returncode == 0, done.stderr
    assert _fields(done.stdout)["transport"] == "h1"


async def test_request_ticket_file_resumes_in_zero_rtt(
    servers: Servers, dev_certs: DevCertificates, tmp_path: Path
) -> None:
    ticket = tmp_path / "session.ticket"
    url = f"https://localhost:{servers.h3_port}/v1/chat/completions"
    args = ("bench.request", url, "--json", CHAT, "--h3", "--cacert", str(dev_certs.ca_cert))
    first = await run_command(*args, "--ticket", str(ticket))
    assert first.returncode == 0, first.stderr
    assert _fields(first.stdout)["early data"] == "not used"
    assert ticket.exists()
    assert stat.S_IMODE(ticket.stat().st_mode) == 0o600
    for _ in range(2):  # each 0-RTT call leaves the next ticket in the file
        again = await run_command(*args, "--ticket", str(ticket))
        assert again.returncode == 0, again.stderr
        assert _fields(again.stdout)["early data"] == "accepted (0-RTT)"
        assert again.stdout.startswith("".join(WORDS))


async def test_request_ticket_file_keeps_the_address_token(
    dev_certs: DevCertificates, tmp_path: Path
) -> None:
    """The server's address token (NEW_TOKEN) goes to the ticket file beside the ticket, and
    the next call presents it: its address is validated at once, its answer not held to three
    times the bytes the server received (RFC 9000 §8.1)."""
    metrics = TransportMetrics(CollectorRegistry())
    ticket = tmp_path / "session.ticket"
    async with edge_h3(dev_certs, metrics=metrics) as server:
        url = f"https://localhost:{server.port}/v1/chat/completions"
        args = ("bench.request", url, "--json", CHAT, "--h3", "--cacert", str(dev_certs.ca_cert))
        first = await run_command(*args, "--ticket", str(ticket))
        assert first.returncode == 0, first.stderr
        _, saved = load_tickets(ticket)
        assert set(saved) == {"localhost"}
        assert server.address_tokens is not None
        assert server.address_tokens.valid(saved["localhost"], "127.0.0.1")
        again = await run_command(*args, "--ticket", str(ticket))
        assert again.returncode == 0, again.stderr
        assert _fields(again.stdout)["early data"] == "accepted (0-RTT)"
    assert metrics.address_tokens.labels("accepted")._value.get() == 1
    _, resaved = load_tickets(ticket)
    assert resaved["localhost"] != saved["localhost"]  # used once; the new one is kept


def test_a_malformed_token_line_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "session.ticket"
    bad.write_text('{"address_token": "not base64!", "server_name": "localhost"}\n')
    with pytest.raises(ValueError, match="malformed stored address token"):
        TicketStore(bad)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--json", "{not json"], "not valid JSON"),
        (["--json", "[1]"], "must be a JSON object"),
        (["--json", "{}", "--h2"], "needs an https:// URL"),
        (["--json", "{}", "--h1", "--ticket", "t"], "--ticket needs HTTP/3"),
        (["--json", "{}", "-H", "nocolon"], "Name: value"),
    ],
)
def test_request_bad_input_is_a_clear_error(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        request_main(["http://127.0.0.1:9/v1/chat/completions", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


async def test_request_bad_ticket_file_is_a_clear_error(servers: Servers, tmp_path: Path) -> None:
    bad = tmp_path / "bad.ticket"
    bad.write_text("garbage\n")
    url = f"https://localhost:{servers.h3_port}/v1/chat/completions"
    done = await run_command("bench.request", url, "--json", "{}", "--ticket", str(bad))
    assert done.returncode == 2
    assert "cannot read ticket file" in done.stderr


async def test_request_failure_exits_nonzero(dev_certs: DevCertificates) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
    done = await run_command("bench.request", url, "--json", "{}", "--timeout", "5")
    assert done.returncode == 1
    assert "error: " in done.stdout
