"""`quicedge request --ticket FILE` where FILE cannot be written: refused before the request,
in one line. The request was sent, its answer printed, and then saving the ticket ended the
command with a traceback."""

from __future__ import annotations

from pathlib import Path

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
