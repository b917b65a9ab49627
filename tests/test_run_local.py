"""`scripts/run-local.sh` (what `make run` starts), run for real: its stand-in backends must be
its own, and whatever it started stops with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from bench.children import free_port

ROOT = Path(__file__).parents[1]


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stand_in_that_cannot_listen_stops_the_script_before_the_edge() -> None:
    """A port held by another process (a stack still running, another server) made the
    stand-in on it exit at once; the script went on and started the edge in front of that
    other process, and printed its banner as if both stand-ins were up."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        environ["SIM_PORTS"] = f"{taken} {free_port()}"
        child = subprocess.Popen(
            ["bash", "scripts/run-local.sh"], cwd=ROOT, env=environ, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            out, err = child.communicate(timeout=45)
        finally:
            if not _gone(child.pid):
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    assert child.returncode != 0
    assert "quicedge local stack" not in out, out
    assert f"the stand-in backend on 127.0.0.1:{taken} did not start" in err, err
    assert _gone(child.pid)  # the other stand-in, which did start, was stopped too
