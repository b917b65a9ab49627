"""A port that another process listens on, with several workers: their SO_REUSEPORT let them
share it with that process (another `quicedge serve --workers 2`, say) instead of failing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.helpers import child_output, free_port, free_udp_port


@pytest.mark.parametrize("taken", ["--tcp", "--h3"])
def test_a_port_another_process_shares_out_stops_several_workers(
    taken: str, redis_url: str
) -> None:
    """The holder binds with SO_REUSEPORT, as a running serve's workers do: the new serve's
    workers joined its group, said `ready` and took part of its traffic."""
    kind = socket.SOCK_STREAM if taken == "--tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        ports = {"--tcp": f"127.0.0.1:{free_port()}", "--h3": f"127.0.0.1:{free_udp_port()}"}
        ports[taken] = address
        cmd = [
            sys.executable, "-m", "edge.cli", "serve", "--demo", "--workers", "2",
            "--redis", redis_url, "--admin", f"127.0.0.1:{free_port()}",
            *(x for flag, value in ports.items() for x in (flag, value)),
        ]  # fmt: skip
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
            try:
                deadline = time.monotonic() + 60
                while proc.poll() is None:
                    assert "ready" not in child_output(out).split(), "serve shares the port"
                    assert time.monotonic() < deadline, child_output(err)
                    time.sleep(0.02)
            finally:
                if proc.poll() is None:  # with its workers
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            errors = child_output(err)
    assert proc.returncode == 1, errors
    protocol = "TCP" if kind == socket.SOCK_STREAM else "UDP"
    assert f"cannot listen on {address} ({protocol}): Address already in use" in errors
